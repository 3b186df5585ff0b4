package wire

import (
	"bytes"
	"fmt"
	"testing"

	"google.golang.org/protobuf/encoding/protowire"
)

// TestValidationErrorsStayShort: a stored value with a 1 MiB annotation key, or with
// thousands of invalid keys, must not turn into a multi-megabyte error on every read.
func TestValidationErrorsStayShort(t *testing.T) {
	encode := func(annos []Annotation) []byte {
		b := protowire.AppendTag(nil, fieldEncryptedData, protowire.BytesType)
		b = protowire.AppendBytes(b, []byte("ciphertext"))
		return AppendTail(b, "key-1", []byte("dek"), annos, SourceHKDFSeed)
	}
	var many []Annotation
	for i := 0; i < 5000; i++ {
		many = append(many, Annotation{Key: []byte(fmt.Sprintf("NOT_A_DOMAIN_%05d", i)), Value: []byte("v")})
	}
	for name, v := range map[string][]byte{
		"1 MiB key":          encode([]Annotation{{Key: bytes.Repeat([]byte("A"), 1<<20), Value: []byte("v")}}),
		"1 MiB dotted key":   encode([]Annotation{{Key: append(bytes.Repeat([]byte("a"), 1<<20), ".example.com"...), Value: nil}}),
		"5,000 invalid keys": encode(many),
		"repeated 1 MiB key": encode([]Annotation{{Key: bytes.Repeat([]byte("a"), 1<<20)}, {Key: bytes.Repeat([]byte("a"), 1<<20)}}),
	} {
		var o Object
		_, err := Decode(v, &o, nil)
		if err == nil {
			t.Fatalf("%s: decoded without error", name)
		}
		if n := len(err.Error()); n > 2048 {
			t.Errorf("%s: error is %d bytes", name, n)
		}
	}
}
