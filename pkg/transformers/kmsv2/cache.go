package kmsv2

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/hkdf"
	"crypto/sha256"
	"fmt"
	"sync"

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
	seed []byte      // SourceHKDFSeed
	aead cipher.AEAD // SourceAESGCMKey
}

func newDEKEntry(typ wire.SourceType, plaintext []byte) (*dekEntry, error) {
	switch typ {
	case wire.SourceHKDFSeed:
		if len(plaintext) < seedSize {
			return nil, fmt.Errorf("invalid seed length %d used for key generation (want at least %d); the plugin returned a wrong plaintext", len(plaintext), seedSize)
		}
		return &dekEntry{typ: typ, seed: append([]byte(nil), plaintext...)}, nil
	case wire.SourceAESGCMKey:
		a, err := newGCM(plaintext)
		if err != nil {
			return nil, err
		}
		return &dekEntry{typ: typ, aead: a}, nil
	}
	return nil, fmt.Errorf("unknown encryptedDEKSourceType: %d", typ)
}

func newGCM(key []byte) (cipher.AEAD, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("the plugin returned a DEK of %d bytes, not an AES key: %w", len(key), err)
	}
	return cipher.NewGCM(block)
}

// deriveGCM is kube-apiserver's seed scheme: AES-256-GCM under the first 32 bytes of
// HKDF-SHA256-Expand(PRK = seed, info). There is no Extract step.
func deriveGCM(seed, info []byte) (cipher.AEAD, error) {
	key, err := hkdf.Expand(sha256.New, seed, string(info), keySize)
	if err != nil {
		return nil, fmt.Errorf("failed to derive a key from the DEK seed: %w", err)
	}
	return newGCM(key)
}

// dekCache maps DEK-source identities to decrypted sources. It is bounded in entries
// (so in memory: an entry is a ≤1 KiB-bounded seed or one AES key schedule) and evicts
// the oldest insertion first; nothing is added per write.
type dekCache struct {
	mu   sync.RWMutex
	m    map[wire.CacheKey]*dekEntry
	ring []wire.CacheKey
	next int
	pm   *providerMetrics
}

func newDEKCache(size int, pm *providerMetrics) *dekCache {
	if size < 1 {
		size = 1
	}
	return &dekCache{m: make(map[wire.CacheKey]*dekEntry, size), ring: make([]wire.CacheKey, 0, size), pm: pm}
}

func (c *dekCache) get(k wire.CacheKey) *dekEntry {
	c.mu.RLock()
	e := c.m[k]
	c.mu.RUnlock()
	return e
}

func (c *dekCache) put(k wire.CacheKey, e *dekEntry) *dekEntry {
	c.mu.Lock()
	defer c.mu.Unlock()
	if old, ok := c.m[k]; ok {
		return old
	}
	if len(c.ring) < cap(c.ring) {
		c.ring = append(c.ring, k)
	} else {
		delete(c.m, c.ring[c.next])
		c.ring[c.next] = k
		c.next = (c.next + 1) % len(c.ring)
		c.pm.evictions.Inc()
	}
	c.m[k] = e
	c.pm.size.Set(float64(len(c.m)))
	return e
}

func (c *dekCache) len() int {
	c.mu.RLock()
	defer c.mu.RUnlock()
	return len(c.m)
}

// aeadKey names one derived key: the seed it comes from and the info.
type aeadKey struct {
	e    *dekEntry
	info [infoSize]byte
}

// aeadCache keeps recently derived AES-GCM instances, so reading values written under
// one generation (ours reuse an info for many writes) skips HKDF and key expansion.
type aeadCache struct {
	mu   sync.RWMutex
	m    map[aeadKey]cipher.AEAD
	ring []aeadKey
	next int
}

func newAEADCache(size int) *aeadCache {
	return &aeadCache{m: make(map[aeadKey]cipher.AEAD, size), ring: make([]aeadKey, 0, size)}
}

func (c *aeadCache) get(k aeadKey) cipher.AEAD {
	c.mu.RLock()
	a := c.m[k]
	c.mu.RUnlock()
	return a
}

func (c *aeadCache) put(k aeadKey, a cipher.AEAD) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if _, ok := c.m[k]; ok {
		return
	}
	if len(c.ring) < cap(c.ring) {
		c.ring = append(c.ring, k)
	} else {
		delete(c.m, c.ring[c.next])
		c.ring[c.next] = k
		c.next = (c.next + 1) % len(c.ring)
	}
	c.m[k] = a
}
