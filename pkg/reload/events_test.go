package reload

import (
	"slices"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

func TestDroppedKeys(t *testing.T) {
	k1 := transformers.KeyInfo{Provider: "aesgcm", Key: "k1", Check: "c1"}
	k2 := transformers.KeyInfo{Provider: "aesgcm", Key: "k2", Check: "c2"}
	kmsOld := transformers.KeyInfo{Provider: "kms", Key: "vault", KeyIDHash: "sha256:aa"}
	kmsNew := transformers.KeyInfo{Provider: "kms", Key: "vault", KeyIDHash: "sha256:bb"}
	before := []transformers.RuleInfo{
		{Resource: "secrets", ReadKeys: []transformers.KeyInfo{k2, k1}},
		{Resource: "configmaps", ReadKeys: []transformers.KeyInfo{kmsOld}},
		{Resource: "widgets.example.com", ReadKeys: []transformers.KeyInfo{k1}},
	}
	after := []transformers.RuleInfo{
		{Resource: "secrets", ReadKeys: []transformers.KeyInfo{k2}},
		// A new KMS key id is the plugin's rotation, not a dropped key.
		{Resource: "configmaps", ReadKeys: []transformers.KeyInfo{kmsNew}},
	}
	want := []string{
		"secrets: key aesgcm/k1 is no longer read",
		"widgets.example.com: key aesgcm/k1 is no longer read",
	}
	if got := droppedKeys(before, after); !slices.Equal(got, want) {
		t.Errorf("droppedKeys = %q, want %q", got, want)
	}
}
