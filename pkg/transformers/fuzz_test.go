package transformers_test

import (
	"bytes"
	"context"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"
)

// FuzzOpenLocal feeds arbitrary stored bytes to a chain of every local provider: reads
// never panic, and an authenticated provider (aesgcm, secretbox) only ever returns
// what was really written.
func FuzzOpenLocal(f *testing.F) {
	p := loadPair(f, "all", configFor("secrets", "aesgcm", "secretbox", "aescbc", "identity"))
	tr := p.our(secrets)
	aad := value.DefaultContext("/registry/secrets/ns/fuzz")
	ctx := context.Background()
	for _, provider := range []string{"aesgcm", "secretbox", "aescbc"} {
		w := loadPair(f, provider, configFor("secrets", provider))
		v, err := w.our(secrets).TransformToStorage(ctx, []byte("seed plaintext"), aad)
		if err != nil {
			f.Fatal(err)
		}
		f.Add(v)
	}
	f.Add([]byte("k8s:enc:aescbc:v1:key1:0123456789abcdef"))
	f.Add([]byte("plain"))
	f.Fuzz(func(t *testing.T, data []byte) {
		out, _, err := tr.TransformFromStorage(ctx, data, aad)
		if err != nil {
			return
		}
		// Keys are deterministic, nonces are not: the seeds are genuine values in every
		// fuzz worker, and a genuine value decrypts to the seed plaintext. Anything else
		// an authenticated provider accepts is a forgery.
		authenticated := bytes.HasPrefix(data, []byte("k8s:enc:aesgcm:")) || bytes.HasPrefix(data, []byte("k8s:enc:secretbox:"))
		if authenticated && !bytes.Equal(out, []byte("seed plaintext")) {
			t.Fatalf("an authenticated provider accepted forged bytes (%d bytes out)", len(out))
		}
	})
}
