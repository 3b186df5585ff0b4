package kmsv2

import (
	"crypto/cipher"
	"crypto/rand"
	"encoding/binary"
	"fmt"
	"sync"
	"sync/atomic"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// maxWritesPerGeneration bounds how many values one derived key encrypts before a new
// info (so a new key) is drawn. See docs/kmsv2-crypto.md.
const maxWritesPerGeneration = 1 << 32

// generation is one derived write key: info ‖ nonce = prefix(4, random) ‖ counter(8, LE),
// or, when its AEAD draws random nonces (FactoryOptions.RandomNonces), info ‖ a random
// nonce; the counter then only bounds the writes under the key.
type generation struct {
	info        [infoSize]byte
	noncePrefix [4]byte
	aead        cipher.AEAD
	counter     atomic.Uint64
}

// writeState is the data-path form of a state.WriteState: the encoded constant tail of
// every value (fields 2..5), the seed and the current generation.
type writeState struct {
	spec  *state.WriteState
	keyID string
	// keyIDHash is state.KeyIDHash(keyID), computed once: the write path's key counter
	// (transformers.WriteCounts) reads it per write.
	keyIDHash string
	typ       wire.SourceType
	tail      []byte
	entry     *dekEntry
	cacheKey  wire.CacheKey
	expiry    atomic.Int64 // unix nanoseconds; writes at or after it fail

	genMu sync.Mutex
	gen   atomic.Pointer[generation]
	limit uint64

	// writes counts the values sealed with this seed; reaching maxWrites (0: no
	// bound) calls full once, which asks the driver for a new seed. Writes go on with
	// this one until it is published.
	writes    atomic.Uint64
	maxWrites uint64
	full      func()
	// random: the generations' AEADs draw their nonces (FactoryOptions.RandomNonces).
	random bool
}

func newWriteState(spec *state.WriteState, limit, maxWrites uint64, randomNonces bool, full func()) (*writeState, error) {
	if spec.Type != wire.SourceHKDFSeed {
		return nil, fmt.Errorf("kms v2: writing DEK source type %s is not supported; rekey writes %s", spec.Type, wire.SourceHKDFSeed)
	}
	entry, err := newDEKEntry(spec.Type, spec.Source, randomNonces)
	if err != nil {
		return nil, err
	}
	ws := &writeState{
		spec:      spec,
		keyID:     spec.KeyID,
		keyIDHash: state.KeyIDHash(spec.KeyID),
		typ:       spec.Type,
		tail:      wire.AppendTail(nil, spec.KeyID, spec.Ciphertext, spec.Annotations, spec.Type),
		entry:     entry,
		cacheKey: wire.ComputeCacheKey(spec.Type, spec.Ciphertext, []byte(spec.KeyID),
			append([]wire.Annotation(nil), spec.Annotations...)),
		limit:     limit,
		maxWrites: maxWrites,
		full:      full,
		random:    randomNonces,
	}
	ws.expiry.Store(spec.Expiry.UnixNano())
	if _, err := ws.rotate(nil); err != nil {
		return nil, err
	}
	return ws, nil
}

// rotate installs a fresh generation unless another writer already replaced old.
func (ws *writeState) rotate(old *generation) (*generation, error) {
	ws.genMu.Lock()
	defer ws.genMu.Unlock()
	if cur := ws.gen.Load(); cur != old {
		return cur, nil
	}
	g := &generation{}
	if _, err := rand.Read(g.info[:]); err != nil {
		return nil, fmt.Errorf("kms v2: cannot read random bytes for a key derivation: %w", err)
	}
	if _, err := rand.Read(g.noncePrefix[:]); err != nil {
		return nil, fmt.Errorf("kms v2: cannot read random bytes for a nonce: %w", err)
	}
	a, err := deriveGCM(ws.entry.seed, g.info[:], ws.random)
	if err != nil {
		return nil, err
	}
	g.aead = a
	ws.gen.Store(g)
	return g, nil
}

// next reserves a unique (generation, counter) pair.
func (ws *writeState) next() (*generation, uint64, error) {
	for {
		g := ws.gen.Load()
		if c := g.counter.Add(1); c <= ws.limit {
			return g, c, nil
		}
		if _, err := ws.rotate(g); err != nil {
			return nil, 0, err
		}
	}
}

// seal writes prefix ‖ EncryptedObject into one allocation: field 1 (info ‖ nonce ‖
// GCM ciphertext ‖ tag) followed by the precomputed fields 2..5.
func (ws *writeState) seal(prefix, plaintext, aad []byte) ([]byte, error) {
	g, ctr, err := ws.next()
	if err != nil {
		return nil, err
	}
	if ws.writes.Add(1) == ws.maxWrites {
		ws.full()
	}
	dataLen := infoSize + nonceSize + len(plaintext) + tagSize
	head := len(prefix) + protowire.SizeTag(1) + protowire.SizeVarint(uint64(dataLen))
	out := make([]byte, head+dataLen+len(ws.tail))
	copy(out, prefix)
	b := protowire.AppendTag(out[:len(prefix)], 1, protowire.BytesType)
	b = protowire.AppendVarint(b, uint64(dataLen))
	b = append(b, g.info[:]...)
	if ws.random {
		g.aead.Seal(b, nil, plaintext, aad) // appends its nonce ‖ ciphertext ‖ tag
	} else {
		b = append(b, g.noncePrefix[:]...)
		b = binary.LittleEndian.AppendUint64(b, ctr)
		nonce := b[len(b)-nonceSize:]
		g.aead.Seal(b, nonce, plaintext, aad)
	}
	copy(out[head+dataLen:], ws.tail)
	return out, nil
}
