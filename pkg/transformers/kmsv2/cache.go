package kmsv2

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"fmt"
	"sync"
	"sync/atomic"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// Sizes of the HKDF seed scheme.
const (
	seedSize  = 32
	infoSize  = 32
	nonceSize = 12
	tagSize   = 16
	keySize   = 32
)

// dekEntry is a decrypted DEK source: a seed (keys are derived per info) or an AES key.
type dekEntry struct {
	typ  wire.SourceType
	seed state.Secret // SourceHKDFSeed
	aead cipher.AEAD  // SourceAESGCMKey
	// lastUsed is when a read last used the entry, in the provider's coarse clock
	// (unix nanoseconds); the idle sweep drops entries unused for DEKCacheIdle. A
	// pointer, so an entry can still be copied (Format) without copying an atomic.
	lastUsed *atomic.Int64
}

// touch records a use at t. Most reads find t already stored and write nothing, so
// readers on many cores do not contend for the cache line.
func (e *dekEntry) touch(t int64) {
	if e.lastUsed.Load() < t {
		e.lastUsed.Store(t)
	}
}

// Format implements fmt.Formatter: fmt prints unexported fields raw (their methods are
// out of its reach), so the entry renders itself with the seed redacted.
func (e dekEntry) Format(f fmt.State, _ rune) {
	fmt.Fprintf(f, "dekEntry{type: %v, seed: %v, aead: %t}", e.typ, e.seed, e.aead != nil)
}

func newDEKEntry(typ wire.SourceType, plaintext []byte, randomNonces bool) (*dekEntry, error) {
	switch typ {
	case wire.SourceHKDFSeed:
		// Exactly 32 bytes: every seed kube-apiserver or rekey writes has that size, and a
		// plugin answering with more (up to the 4 MiB gRPC limit) must not get its reply
		// copied into the cache, which holds up to 1,024 entries.
		if len(plaintext) != seedSize {
			return nil, fmt.Errorf("invalid seed length %d used for key generation (want %d); the plugin's Decrypt returned a wrong plaintext — check that it decrypts with the key that encrypted the DEK seed", len(plaintext), seedSize)
		}
		return &dekEntry{typ: typ, seed: append([]byte(nil), plaintext...), lastUsed: new(atomic.Int64)}, nil
	case wire.SourceAESGCMKey:
		a, err := newGCM(plaintext, randomNonces)
		if err != nil {
			return nil, err
		}
		return &dekEntry{typ: typ, aead: a, lastUsed: new(atomic.Int64)}, nil
	}
	return nil, fmt.Errorf("unknown encryptedDEKSourceType: %d", typ)
}

// newGCM is AES-GCM under key: with randomNonces, Go's NewGCMWithRandomNonce (its
// NonceSize is 0: Seal draws the nonce and writes it first, Open reads it from there),
// the one AES-GCM construction GODEBUG=fips140=only allows; otherwise cipher.NewGCM,
// which seals under the nonce the caller gives (the write generation's counter).
func newGCM(key []byte, randomNonces bool) (cipher.AEAD, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("the plugin returned a DEK of %d bytes, not an AES key: %w", len(key), err)
	}
	if randomNonces {
		return cipher.NewGCMWithRandomNonce(block)
	}
	return cipher.NewGCM(block)
}

// deriveGCM is kube-apiserver's seed scheme: AES-256-GCM under the first 32 bytes of
// HKDF-SHA256-Expand(PRK = seed, info). There is no Extract step.
func deriveGCM(seed, info []byte, randomNonces bool) (cipher.AEAD, error) {
	key, err := hkdf.Expand(sha256.New, seed, string(info), keySize)
	if err != nil {
		return nil, fmt.Errorf("failed to derive a key from the DEK seed: %w", err)
	}
	return newGCM(key, randomNonces)
}

// fifoCache is a map bounded in entries that evicts the oldest insertion first; nothing
// is added per write. It backs the DEK-source cache (an entry is a 32-byte seed or
// one AES key schedule, so entries bound memory too) and the derived-key cache.
type fifoCache[K comparable, V any] struct {
	mu   sync.RWMutex
	m    map[K]V
	ring []K
	next int
	// changed, when set, runs under the lock after an insertion with the new size and
	// whether an entry was evicted (for metrics).
	changed func(size int, evicted bool)
}

func newFIFOCache[K comparable, V any](size int, changed func(size int, evicted bool)) *fifoCache[K, V] {
	size = max(size, 1)
	return &fifoCache[K, V]{m: make(map[K]V, size), ring: make([]K, 0, size), changed: changed}
}

// get returns the value for k, or the zero value.
func (c *fifoCache[K, V]) get(k K) V {
	c.mu.RLock()
	v := c.m[k]
	c.mu.RUnlock()
	return v
}

// put stores v under k unless k is present, and returns the value now cached for k.
func (c *fifoCache[K, V]) put(k K, v V) V {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[k]; ok {
		return old
	}
	evicted := false
	if len(c.ring) < cap(c.ring) {
		c.ring = append(c.ring, k)
	} else {
		delete(c.m, c.ring[c.next])
		c.ring[c.next] = k
		c.next = (c.next + 1) % len(c.ring)
		evicted = true
	}
	c.m[k] = v
	if c.changed != nil {
		c.changed(len(c.m), evicted)
	}
	return v
}

// removeIf deletes every entry for which drop is true, keeping the insertion order of
// the rest, and returns how many it deleted.
func (c *fifoCache[K, V]) removeIf(drop func(K, V) bool) int {
	c.mu.Lock()
	defer c.mu.Unlock()
	// Oldest first: once the ring is full, next points at the oldest key.
	ordered := append(c.ring[c.next:len(c.ring):len(c.ring)], c.ring[:c.next]...)
	kept := make([]K, 0, cap(c.ring))
	for _, k := range ordered {
		if drop(k, c.m[k]) {
			delete(c.m, k)
			continue
		}
		kept = append(kept, k)
	}
	removed := len(c.ring) - len(kept)
	c.ring, c.next = kept, 0
	if removed > 0 && c.changed != nil {
		c.changed(len(c.m), false)
	}
	return removed
}

func (c *fifoCache[K, V]) len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.m)
}

// dekCache maps DEK-source identities to decrypted sources.
type dekCache = fifoCache[wire.CacheKey, *dekEntry]

func newDEKCache(size int, pm *providerMetrics) *dekCache {
	return newFIFOCache[wire.CacheKey, *dekEntry](size, func(n int, evicted bool) {
		if evicted {
			pm.evictions.Inc()
		}
		pm.size.Set(float64(n))
	})
}

// aeadKey names one derived key: the seed it comes from and the info.
type aeadKey struct {
	e    *dekEntry
	info [infoSize]byte
}

// aeadCache keeps recently derived AES-GCM instances, so reading values written under
// one generation (ours reuse an info for many writes) skips HKDF and key expansion.
type aeadCache = fifoCache[aeadKey, cipher.AEAD]

func newAEADCache(size int) *aeadCache { return newFIFOCache[aeadKey, cipher.AEAD](size, nil) }
