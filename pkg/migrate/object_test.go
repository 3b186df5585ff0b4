package migrate

import (
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
