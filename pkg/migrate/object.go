package migrate

import (
	"bytes"
	"encoding/json"
	"errors"

	"k8s.io/apimachinery/pkg/runtime"
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
		var u runtime.Unknown
		if err := u.Unmarshal(plain[len(protobufMagic):]); err != nil {
			return errNotAnObject
		}
		if u.Kind == "" || u.APIVersion == "" {
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
