package kmsv2

import (
	"bytes"
	"context"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"
)

// FuzzProviderOpen feeds arbitrary stored bytes (after the prefix) to a provider backed by
// a real plugin: reads never panic, and a read that succeeds returns what was really
// written (AES-GCM authenticates the value and its etcd key).
func FuzzProviderOpen(f *testing.F) {
	tp := startPlugin(f, "fuzz-key")
	p := newProvider(f, "fuzz", tp.endpoint, FactoryOptions{})
	aad := value.DefaultContext("/registry/secrets/ns/fuzz")
	want := []byte("fuzz plaintext")
	v, err := p.Seal(context.Background(), want, aad)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(v[len(p.Prefix()):])
	f.Add([]byte{})
	f.Add([]byte{0x0a, 0x00})
	f.Fuzz(func(t *testing.T, data []byte) {
		out, _, err := p.Open(context.Background(), data, aad)
		if err == nil && !bytes.Equal(out, want) {
			t.Fatalf("a forged value decrypted to %d bytes", len(out))
		}
	})
}
