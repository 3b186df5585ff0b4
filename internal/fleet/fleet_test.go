package fleet

import (
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// A member's published rules become an inventory's source: every read key's stored
// prefix, the KMS v2 writer's key id hash, the index of the writer.
func TestRulesFromMembers(t *testing.T) {
	kms := transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: "sha256:abc"}
	old := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "k1", Check: "c1"}
	m := cluster.MemberState{APIServerID: "a", ConfigHash: "h", Resources: []cluster.ResourceState{{Resource: "secrets", Write: kms, Read: []cluster.Key{kms, old, {Provider: transformers.ProviderIdentity}}}}}
	rules := Rules([]cluster.MemberState{m})
	if len(rules) != 1 {
		t.Fatalf("rules = %+v", rules)
	}
	r := rules[0]
	want := []string{"k8s:enc:kms:v2:vault:", "k8s:enc:aesgcm:v1:k1:", ""}
	if r.WritePrefix != want[0] || r.KMS == nil || r.KMS.KeyIDHash != "sha256:abc" || strings.Join(r.ReadPrefixes, ",") != strings.Join(want, ",") || r.WriteIndex != 0 {
		t.Fatalf("rule = %+v", r)
	}
	if Rules(nil) != nil {
		t.Fatal("rules without members")
	}
}

// A resource whose rule writes identity is plaintext by configuration: the row counts
// it and names the rule; a row without problems lists nothing.
func TestSummarize(t *testing.T) {
	id := transformers.KeyInfo{Provider: transformers.ProviderIdentity}
	gcm := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "k1", Check: "c1"}
	members := []cluster.MemberState{{APIServerID: "a", ConfigHash: "h", Resources: []cluster.ResourceState{
		{Resource: "secrets", Write: gcm, Read: []cluster.Key{gcm}}, {Resource: "configmaps", Write: id, Read: []cluster.Key{id}},
	}}}
	now := time.Now()
	inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{
		{Resource: "secrets", WritePrefix: "k8s:enc:aesgcm:v1:k1:", Objects: 5, Revision: 9},
		{Resource: "configmaps", WritePrefix: "", Objects: 3, Plaintext: 3, Revision: 9},
	}}
	totals := []cluster.KeyTotal{{Key: gcm, Writes: 1 << 31, FirstSeen: now.Add(-48 * time.Hour)}}
	r := Summarize("c", &cluster.Snapshot{Members: members}, inv, totals, now, time.Hour)
	if r.Plaintext != 3 || r.NotOnWriteKey != 0 || r.BudgetUsed != 0.5 || r.WriteKeyAge != 48*time.Hour || r.Revision != 9 {
		t.Fatalf("row = %+v", r)
	}
	text := strings.Join(r.Attention, "; ")
	for _, want := range []string{"configmaps: written in plaintext (its rule writes identity)", "3 objects in plaintext", "50% of its write budget"} {
		if !strings.Contains(text, want) {
			t.Errorf("attention lacks %q: %s", want, text)
		}
	}
	inv.Resources = inv.Resources[:1]
	totals[0].Writes = 10
	if r := Summarize("c", &cluster.Snapshot{Members: members}, inv, totals, now, time.Hour); r.NeedsAttention() {
		t.Fatalf("a healthy cluster needs attention: %v", r.Attention)
	}
}
