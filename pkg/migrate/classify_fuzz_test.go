package migrate

import (
	"bytes"
	"encoding/hex"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// FuzzClassify: any stored bytes classify without panicking into a well-formed bucket,
// and checkStoredObject never panics on any plaintext.
func FuzzClassify(f *testing.F) {
	rule := transformers.RuleInfo{
		Resource: "secrets", WriteProvider: "kms", WriteKey: "plug", WritePrefix: "k8s:enc:kms:v2:plug:",
		ReadPrefixes: []string{"k8s:enc:kms:v2:plug:", "k8s:enc:aescbc:v1:a:", "k8s:enc:aescbc:v1:a:bcdefghijklmnop:", ""},
		KMS:          &transformers.KMSStatus{Name: "plug", KeyIDHash: "sha256:" + strings.Repeat("0", 64), DEKSourceType: "HKDF_SHA256_XNONCE_AES_GCM_SEED"},
	}
	cl := newClassifier(rule, []string{"k8s:enc:aesgcm:v1:key1:", "k8s:enc:secretbox:v1:k:"})
	f.Add([]byte(kmsValue("plug", "key-a")))
	f.Add([]byte(kmsValue("other", "key-b")))
	f.Add([]byte("k8s:enc:aescbc:v1:a:bcdefghijklmnop:0123456789abcdef"))
	f.Add([]byte("k8s:enc:aesgcm:v1:ghost:\x01\x02"))
	f.Add([]byte("k8s:enc:"))
	f.Add([]byte("k8s:enc:kms:v1:old:xyz"))
	f.Add(storedObject("plain"))
	f.Add([]byte(`{"apiVersion":"v1","kind":"Secret"}`))
	f.Add([]byte{0xd9, 0xd9, 0xf7, 0xa1, 0x61, 0x61, 0x01})
	providers := map[string]bool{transformers.ProviderIdentity: true, transformers.ProviderAESGCM: true, transformers.ProviderAESCBC: true, transformers.ProviderSecretbox: true, transformers.ProviderKMSv2: true, transformers.ProviderKMSv1: true, transformers.ProviderUnknown: true}
	f.Fuzz(func(t *testing.T, v []byte) {
		_ = checkStoredObject(v)
		b := cl.classify(v)
		if !providers[b.Provider] {
			t.Fatalf("provider %q", b.Provider)
		}
		if !bytes.HasPrefix(v, []byte(b.Prefix)) {
			t.Fatalf("prefix %q is not a prefix of the value", b.Prefix)
		}
		encrypted := bytes.HasPrefix(v, []byte(encryptedMarker))
		if (b.Provider == transformers.ProviderIdentity) == encrypted || (b.Prefix == "") == encrypted {
			t.Fatalf("value encrypted=%v classified as %+v", encrypted, b)
		}
		configured := false
		for _, p := range cl.known {
			configured = configured || string(p) == b.Prefix
		}
		// Configured key names may contain ':'; names read from unknown values may not.
		if !configured && (strings.Contains(b.Key, ":") || len(b.Key) > maxGuessedKeyName) {
			t.Fatalf("key name %q read from an unknown prefix", b.Key)
		}
		if b.KeyIDHash != "" {
			h, ok := strings.CutPrefix(b.KeyIDHash, "sha256:")
			if _, err := hex.DecodeString(h); !ok || err != nil || len(h) != 64 || b.Provider != transformers.ProviderKMSv2 {
				t.Fatalf("key id hash %q for provider %s", b.KeyIDHash, b.Provider)
			}
		}
		switch b.DEKSourceType {
		case "", "AES_GCM_KEY", "HKDF_SHA256_XNONCE_AES_GCM_SEED":
		default:
			t.Fatalf("DEK source type %q", b.DEKSourceType)
		}
		if b.KnownKey && !cl.readable[b.Prefix] {
			t.Fatalf("known key for a prefix the rule cannot read: %+v", b)
		}
		if o := newBucketBound(cl); o.admit(b) != b {
			t.Fatal("the first bucket was not admitted as is")
		}
	})
}
