package migrate

import (
	"testing"

	"google.golang.org/protobuf/encoding/protowire"

	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// TestClassifyDecodesKMSValuesAsTheProviderDoes: the inventory reads a KMS v2 value's
// key id with the provider's own decoder (kmsv2/wire), so a value the provider refuses
// (here: no encrypted DEK source, which kube-apiserver's validation rejects) is counted
// unreadable rather than under its key id. Its own decoder used to accept it.
func TestClassifyDecodesKMSValuesAsTheProviderDoes(t *testing.T) {
	rule := transformers.RuleInfo{Resource: "secrets", WriteProvider: "kms", WriteKey: "plug", WritePrefix: "k8s:enc:kms:v2:plug:",
		ReadPrefixes: []string{"k8s:enc:kms:v2:plug:"}, KMS: &transformers.KMSStatus{Name: "plug", KeyIDHash: sha("key-a")}}
	cl := newClassifier(rule, nil)
	if b := cl.classify([]byte(kmsValue("plug", "key-a"))); !b.KnownKey || b.KeyIDHash != sha("key-a") || b.DEKSourceType != "HKDF_SHA256_XNONCE_AES_GCM_SEED" {
		t.Fatalf("a well-formed value: %+v", b)
	}
	var noSource []byte
	noSource = protowire.AppendTag(noSource, 1, protowire.BytesType)
	noSource = protowire.AppendBytes(noSource, []byte("ciphertext"))
	noSource = protowire.AppendTag(noSource, 2, protowire.BytesType)
	noSource = protowire.AppendString(noSource, "key-a")
	var o wire.Object
	if _, err := wire.Decode(noSource, &o, nil); err == nil {
		t.Fatal("the provider's decoder accepts a value without a DEK source; pick another malformed value")
	}
	if b := cl.classify(append([]byte("k8s:enc:kms:v2:plug:"), noSource...)); b.KnownKey || b.KeyIDHash != "" {
		t.Fatalf("a value the provider cannot read is classified %+v, want unreadable with no key id", b)
	}
}
