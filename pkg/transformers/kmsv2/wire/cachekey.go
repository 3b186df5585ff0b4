package wire

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
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

// keyBufs holds scratch buffers: the key bytes are assembled by copying, and hashed
// with sha256.Sum256, so that nothing the caller passes escapes (its stack-allocated
// Object stays on the stack).
var keyBufs = sync.Pool{New: func() any { b := make([]byte, 0, 512); return &b }}

func appendU16(b, v []byte) []byte {
	b = binary.BigEndian.AppendUint16(b, uint16(len(v)))
	return append(b, v...)
}

// ComputeCacheKey hashes the identity of a DEK source. It sorts annos by key.
func ComputeCacheKey(typ SourceType, dekSource, keyID []byte, annos []Annotation) CacheKey {
	sortAnnotations(annos)
	bp := keyBufs.Get().(*[]byte)
	b := binary.BigEndian.AppendUint32((*bp)[:0], uint32(typ))
	b = appendU16(b, dekSource)
	b = appendU16(b, keyID)
	if len(annos) > 0 {
		b = binary.BigEndian.AppendUint32(b, uint32(len(annos)))
		for _, a := range annos {
			b = appendU16(b, a.Key)
			b = appendU16(b, a.Value)
		}
	}
	out := CacheKey(sha256.Sum256(b))
	if cap(b) <= 64<<10 {
		*bp = b
		keyBufs.Put(bp)
	}
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
