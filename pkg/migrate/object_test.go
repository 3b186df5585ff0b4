package migrate

import (
	"math/rand/v2"
	"slices"
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer/cbor/direct"
)

func TestCheckStoredObject(t *testing.T) {
	pb := func(apiVersion, kind string) []byte {
		u := runtime.Unknown{TypeMeta: runtime.TypeMeta{APIVersion: apiVersion, Kind: kind}, Raw: []byte("\x0a\x03abc")}
		b, err := u.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return append([]byte("k8s\x00"), b...)
	}
	cbor, err := direct.Marshal(map[string]any{"apiVersion": "v1", "kind": "Secret", "data": map[string]any{"a": []byte("b")}})
	if err != nil {
		t.Fatal(err)
	}
	cbor = append([]byte{0xd9, 0xd9, 0xf7}, cbor...)
	for _, tc := range []struct {
		name string
		v    []byte
		ok   bool
	}{
		{"protobuf", pb("v1", "Secret"), true},
		{"protobuf without kind", pb("v1", ""), false},
		{"protobuf garbage", append([]byte("k8s\x00"), 0xff, 0xff, 0x01), false},
		{"json", []byte(`{"apiVersion":"v1","kind":"ConfigMap","data":{"a":"b"}}`), true},
		{"json with leading space", []byte("\n {\"kind\":\"Secret\",\"apiVersion\":\"v1\"}"), true},
		{"json without apiVersion", []byte(`{"kind":"Secret"}`), false},
		{"json truncated", []byte(`{"apiVersion":"v1","kind":"Secret"`), false},
		{"cbor", cbor, true},
		{"cbor truncated", cbor[:len(cbor)-2], false},
		{"random bytes", []byte{0x13, 0x88, 0x01, 0xfe, 0x00, 0x42}, false},
		{"empty", nil, false},
	} {
		if err := checkStoredObject(tc.v); (err == nil) != tc.ok {
			t.Errorf("%s: err=%v, want ok=%v", tc.name, err, tc.ok)
		}
	}
}

// The in-place walk of a protobuf envelope accepts what decoding it into a
// runtime.Unknown (kube-apiserver's own first step) accepts with a kind and an
// apiVersion, and nothing else: checked on a stored Secret and on every truncation and
// on byte mutations of it.
func TestProtobufCheckAgreesWithRuntimeUnknown(t *testing.T) {
	u := runtime.Unknown{
		TypeMeta:    runtime.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		Raw:         []byte("\x0a\x0c\x0a\x04name\x12\x04ns-1\x1a\x05\x0a\x01k\x12\x00"),
		ContentType: "application/vnd.kubernetes.protobuf",
	}
	valid, err := u.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	oracle := func(b []byte) bool {
		var got runtime.Unknown
		return got.Unmarshal(b) == nil && got.Kind != "" && got.APIVersion != ""
	}
	check := func(what string, b []byte) {
		t.Helper()
		if got, want := protobufObjectHasType(b), oracle(b); got != want {
			t.Fatalf("%s (% x): in place %v, runtime.Unknown %v", what, b, got, want)
		}
	}
	check("valid", valid)
	if !protobufObjectHasType(valid) {
		t.Fatal("a valid Secret envelope was refused")
	}
	for i := range valid {
		check("truncated", valid[:i])
	}
	rng := rand.New(rand.NewPCG(34, 1))
	for range 20000 {
		b := slices.Clone(valid)
		for range 1 + rng.IntN(3) {
			b[rng.IntN(len(b))] = byte(rng.IntN(256))
		}
		check("mutated", b)
	}
}
