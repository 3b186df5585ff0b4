package kmsv1_test

import (
	"bytes"
	"context"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv1"
)

// FuzzOpen feeds arbitrary bytes after the KMS v1 prefix to a provider whose plugin
// knows the DEKs of genuine values (GCM and CBC): reads never panic, every failure is
// an error, and what reads as AES-GCM (not stale) is a genuine plaintext: GCM data is
// authenticated, so anything else would be a forgery. CBC data is not, as upstream.
func FuzzOpen(f *testing.F) {
	skipUnderFIPSOnly(f)
	ctx := context.Background()
	kms := newFakeKMS()
	p := kmsv1.NewWithDecrypter("fuzz", 100, asDecrypter{kms})
	seed := []byte("seed plaintext")
	for _, cbc := range []bool{false, true} {
		v, err := upstreamWriter(kms, cbc).TransformToStorage(ctx, seed, aad)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(v)
	}
	f.Add([]byte{})
	f.Add([]byte{0})
	f.Add([]byte{0, 0})
	f.Add([]byte{0xff, 0xff, 1})
	f.Add([]byte{0, 1, 'x'})
	f.Fuzz(func(t *testing.T, data []byte) {
		out, stale, err := p.Open(ctx, data, aad)
		if err != nil {
			return
		}
		if !stale && !bytes.Equal(out, seed) {
			t.Fatalf("AES-GCM accepted forged bytes (%d bytes out)", len(out))
		}
	})
}
