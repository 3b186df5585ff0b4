package wire

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"hash"
	"slices"
	"sync"
)

// CacheKey identifies a DEK source: SHA-256 over the same length-prefixed layout
// kube-apiserver builds its cache key from — uint32(type) ‖ u16-len(encrypted DEK source)
// ‖ u16-len(key id) and, when there are annotations, uint32(count) ‖ (u16-len(key) ‖
// u16-len(value)) for each annotation sorted by key. Annotations are part of the
// identity, so a plugin that returns a constant ciphertext and carries the real
// wrapped key in annotations cannot make two DEKs collide (cache poisoning).
type CacheKey [sha256.Size]byte

type keyHasher struct {
	h   hash.Hash
	buf [4]byte
	sum [sha256.Size]byte
}

var hashers = sync.Pool{New: func() any { return &keyHasher{h: sha256.New()} }}

func (k *keyHasher) u16(b []byte) {
	binary.BigEndian.PutUint16(k.buf[:2], uint16(len(b)))
	k.h.Write(k.buf[:2])
	k.h.Write(b)
}

// ComputeCacheKey hashes the identity of o's DEK source. It sorts o.Annotations by key.
func ComputeCacheKey(typ SourceType, dekSource, keyID []byte, annos []Annotation) CacheKey {
	sortAnnotations(annos)
	k := hashers.Get().(*keyHasher)
	k.h.Reset()
	binary.BigEndian.PutUint32(k.buf[:], uint32(typ))
	k.h.Write(k.buf[:])
	k.u16(dekSource)
	k.u16(keyID)
	if len(annos) > 0 {
		binary.BigEndian.PutUint32(k.buf[:], uint32(len(annos)))
		k.h.Write(k.buf[:])
		for _, a := range annos {
			k.u16(a.Key)
			k.u16(a.Value)
		}
	}
	k.h.Sum(k.sum[:0])
	out := CacheKey(k.sum)
	hashers.Put(k)
	return out
}

// sortAnnotations sorts by key: an insertion sort for the usual short lists (no
// allocation), the standard library's sort for long ones.
func sortAnnotations(a []Annotation) {
	if len(a) > 16 {
		slices.SortFunc(a, func(x, y Annotation) int { return bytes.Compare(x.Key, y.Key) })
		return
	}
	for i := 1; i < len(a); i++ {
		for j := i; j > 0 && string(a[j].Key) < string(a[j-1].Key); j-- {
			a[j], a[j-1] = a[j-1], a[j]
		}
	}
}

// SortedAnnotations converts a plugin's annotation map into a sorted list.
func SortedAnnotations(m map[string][]byte) []Annotation {
	if len(m) == 0 {
		return nil
	}
	out := make([]Annotation, 0, len(m))
	for k, v := range m {
		out = append(out, Annotation{Key: []byte(k), Value: v})
	}
	sortAnnotations(out)
	return out
}
