package wire

import (
	"bytes"
	"testing"

	"google.golang.org/protobuf/proto"
	"k8s.io/apimachinery/pkg/util/validation"
	"k8s.io/apimachinery/pkg/util/validation/field"
	kmstypes "k8s.io/apiserver/pkg/storage/value/encrypt/envelope/kmsv2/v2"
)

func seedObjects(f *testing.F) {
	for _, o := range []*kmstypes.EncryptedObject{
		{EncryptedData: []byte("data"), KeyID: "key-1", EncryptedDEKSource: []byte("dek"), EncryptedDEKSourceType: kmstypes.EncryptedDEKSourceType_HKDF_SHA256_XNONCE_AES_GCM_SEED},
		{EncryptedData: []byte("d"), KeyID: "k", EncryptedDEKSource: []byte("x"), Annotations: map[string][]byte{"a.example.com": []byte("1"), "b.example.com": nil}},
		{EncryptedData: []byte("d"), KeyID: "k", EncryptedDEKSource: []byte("x"), Annotations: map[string][]byte{"panda": []byte("1")}},
	} {
		b, _ := proto.Marshal(o)
		f.Add(b)
	}
	f.Add([]byte{})
	f.Add([]byte{0x28, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x01})
}

// FuzzDecodeEncryptedObject: Decode never panics and accepts exactly what
// kube-apiserver's proto.Unmarshal + ValidateEncryptedObject rules accept (up to the
// documented strictness: repeated annotation keys are rejected).
func FuzzDecodeEncryptedObject(f *testing.F) {
	seedObjects(f)
	f.Fuzz(func(t *testing.T, b []byte) {
		var o Object
		var buf [MaxInlineAnnotations]Annotation
		annos, err := Decode(b, &o, buf[:])
		var up kmstypes.EncryptedObject
		upErr := proto.Unmarshal(b, &up)
		if err != nil {
			return
		}
		if upErr != nil {
			t.Fatalf("we accepted what proto.Unmarshal rejects: %v", upErr)
		}
		if !bytes.Equal(o.Data, up.EncryptedData) || string(o.KeyID) != up.KeyID || !bytes.Equal(o.DEKSource, up.EncryptedDEKSource) ||
			int32(o.SourceType) != int32(up.EncryptedDEKSourceType) || len(annos) != len(up.Annotations) {
			t.Fatalf("decoded %+v, upstream %+v", o, &up)
		}
		for _, a := range annos {
			if v, ok := up.Annotations[string(a.Key)]; !ok || !bytes.Equal(v, a.Value) {
				t.Fatalf("annotation %q differs", a.Key)
			}
		}
		ComputeCacheKey(o.SourceType, o.DEKSource, o.KeyID, annos)
		// Our tail encoder round-trips what we accepted.
		re := AppendTail(nil, string(o.KeyID), o.DEKSource, annos, o.SourceType)
		var back Object
		var buf2 [MaxInlineAnnotations]Annotation
		full := append([]byte{0x0a, byte(len("x")), 'x'}, re...)
		if _, err := Decode(full, &back, buf2[:]); err != nil {
			t.Fatalf("re-encoded value does not decode: %v", err)
		}
	})
}

// FuzzDecodeAnnotationKey: our allocation-free annotation-key check accepts exactly
// what apimachinery's IsFullyQualifiedDomainName accepts.
func FuzzDecodeAnnotationKey(f *testing.F) {
	for _, s := range []string{"a.b", "a.b.", "panda", "-a.b", "a-.b", "A.b", "a..b", ".", "", "x.y.z"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		ours := checkFQDN([]byte(s)) == nil
		theirs := len(validation.IsFullyQualifiedDomainName(field.NewPath("annotations"), s)) == 0
		if ours != theirs {
			t.Fatalf("%q: ours accepts=%v, apimachinery accepts=%v", s, ours, theirs)
		}
	})
}
