package migrate

import (
	"bytes"
	"encoding/json"
	"errors"

	"k8s.io/apimachinery/pkg/runtime/serializer/cbor/direct"
)

// Envelopes of the serializations kube-apiserver stores objects in.
var (
	protobufMagic = []byte("k8s\x00")
	// cborMagic is the self-described CBOR tag kube-apiserver's CBOR serializer writes
	// first (storage in CBOR is behind a feature gate).
	cborMagic = []byte{0xd9, 0xd9, 0xf7}
)

// errNotAnObject marks a value that decrypted without error to something that is not a
// stored Kubernetes object. aescbc has no MAC, so a wrong key "succeeds" with garbage
// whenever the garbage ends in valid padding; rewriting that garbage under the write key
// would make the loss permanent.
var errNotAnObject = errors.New("decrypted to something that is not a stored Kubernetes object (probably read with a wrong key); left unchanged")

// typeMeta is all a stored JSON object must carry.
type typeMeta struct {
	APIVersion string `json:"apiVersion"`
	Kind       string `json:"kind"`
}

// checkStoredObject returns nil when plain decodes the way kube-apiserver's storage
// decoders would start: the protobuf envelope (k8s\x00 + runtime.Unknown with kind and
// apiVersion), a CBOR map with apiVersion and kind, or a JSON object with both. It is
// checked before every rewrite; a value that fails is counted unreadable, never written.
func checkStoredObject(plain []byte) error {
	switch {
	case bytes.HasPrefix(plain, protobufMagic):
		if !protobufObjectHasType(plain[len(protobufMagic):]) {
			return errNotAnObject
		}
		return nil
	case bytes.HasPrefix(plain, cborMagic):
		// The strict decoder refuses unknown fields in a struct, so decode the map.
		var obj map[string]any
		if err := direct.Unmarshal(plain, &obj); err != nil {
			return errNotAnObject
		}
		if v, _ := obj["apiVersion"].(string); v == "" {
			return errNotAnObject
		}
		if k, _ := obj["kind"].(string); k == "" {
			return errNotAnObject
		}
		return nil
	}
	trimmed := bytes.TrimLeft(plain, " \t\r\n")
	if len(trimmed) == 0 || trimmed[0] != '{' {
		return errNotAnObject
	}
	var tm typeMeta
	if err := json.Unmarshal(trimmed, &tm); err != nil || tm.Kind == "" || tm.APIVersion == "" {
		return errNotAnObject
	}
	return nil
}

// protobufObjectHasType reports whether b decodes as a runtime.Unknown (the protobuf
// envelope's message, as the apiserver's generated decoder reads it) whose typeMeta has
// both apiVersion and kind. It walks the wire format in place: decoding into a
// runtime.Unknown copied the whole object (its raw field) for every rewrite, about a
// sixth of what a migration of 1–10 KiB Secrets allocated, in an apiserver whose heap
// holds the watch cache. What it accepts is what that decoder accepts, unknown fields
// and groups included (TestProtobufCheckAgreesWithRuntimeUnknown).
func protobufObjectHasType(b []byte) bool {
	// runtime.Unknown: 1 typeMeta (1 apiVersion, 2 kind), 2 raw, 3 contentEncoding,
	// 4 contentType; every one of them length-delimited.
	var apiVersion, kind bool
	ok := walkFields(b, 4, func(num int, v []byte) bool {
		if num != 1 {
			return true
		}
		return walkFields(v, 2, func(num int, v []byte) bool {
			if num == 1 {
				apiVersion = len(v) > 0
			} else {
				kind = len(v) > 0
			}
			return true
		})
	})
	return ok && apiVersion && kind
}

// walkFields reads the protobuf message b whose fields 1 to known are all
// length-delimited, calling field with each of those; other fields are skipped. It
// reports whether b was well formed, by the rules of the gogo-generated decoders of
// k8s.io/apimachinery (their varints, their group skipping), and every call returned
// true.
func walkFields(b []byte, known int, field func(num int, v []byte) bool) bool {
	for i := 0; i < len(b); {
		start := i
		tag, n := gogoVarint(b[i:])
		if n < 0 {
			return false
		}
		i += n
		num, typ := int64(tag>>3), tag&7
		if typ == 4 || num <= 0 {
			return false
		}
		if num > int64(known) {
			skip := gogoSkip(b[start:])
			if skip < 0 || start+skip > len(b) {
				return false
			}
			i = start + skip
			continue
		}
		if typ != 2 {
			return false
		}
		length, n := gogoVarint(b[i:])
		if n < 0 {
			return false
		}
		i += n
		if int64(length) < 0 || uint64(len(b)-i) < length {
			return false
		}
		if !field(int(num), b[i:i+int(length)]) {
			return false
		}
		i += int(length)
	}
	return true
}

// gogoVarint reads a varint as the gogo-generated decoders do (at most 10 bytes,
// high bits past 64 dropped): the value and its length, or -1.
func gogoVarint(b []byte) (uint64, int) {
	var v uint64
	for i, shift := 0, uint(0); shift < 64; i, shift = i+1, shift+7 {
		if i >= len(b) {
			return 0, -1
		}
		v |= uint64(b[i]&0x7f) << shift
		if b[i] < 0x80 {
			return v, i + 1
		}
	}
	return 0, -1
}

// gogoSkip is the length of the field (with its groups) that starts b, as the
// gogo-generated decoders skip an unknown one, or -1. Like theirs, it does not bound
// fixed-size values by len(b); the caller does.
func gogoSkip(b []byte) int {
	depth := 0
	for i := 0; i < len(b); {
		tag, n := gogoVarint(b[i:])
		if n < 0 {
			return -1
		}
		i += n
		switch tag & 7 {
		case 0:
			_, n := gogoVarint(b[i:])
			if n < 0 {
				return -1
			}
			i += n
		case 1:
			i += 8
		case 2:
			length, n := gogoVarint(b[i:])
			if n < 0 || int(length) < 0 {
				return -1
			}
			i += n + int(length)
		case 3:
			depth++
		case 4:
			if depth == 0 {
				return -1
			}
			depth--
		case 5:
			i += 4
		default:
			return -1
		}
		if i < 0 {
			return -1
		}
		if depth == 0 {
			return i
		}
	}
	return -1
}
