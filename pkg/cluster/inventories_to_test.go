package cluster

import (
	"testing"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestInventoriesToWhileRunningAndUntilTheReScanIsAdopted: the storage controller
// leaves a write-key change of a resource to the migrator from the leader's start of a
// migration to that key until this apiserver's inventory is at least as new as the
// verified record; another resource, another key, an unverified or failed record, and
// an inventory already adopted are left to the controller.
func TestInventoriesToWhileRunningAndUntilTheReScanIsAdopted(t *testing.T) {
	key2 := Key{Provider: transformers.ProviderAESGCM, Key: "key2", Check: "c2"}
	prefix2 := key2.StoredPrefix()
	prefix1 := Key{Provider: transformers.ProviderAESGCM, Key: "key1"}.StoredPrefix()
	store := &migrate.InventoryStore{}
	m := NewMigrator(MigratorOptions{Inventory: store})

	if m.InventoriesTo("secrets", prefix2, "") {
		t.Fatal("no state yet: the change must be the controller's")
	}
	m.setState(MigrationState{Running: &Migration{Resource: "secrets", Target: key2}})
	for _, c := range []struct {
		resource, prefix string
		want             bool
	}{{"secrets", prefix2, true}, {"configmaps", prefix2, false}, {"secrets", prefix1, false}} {
		if got := m.InventoriesTo(c.resource, c.prefix, ""); got != c.want {
			t.Errorf("running secrets to key2: InventoriesTo(%s, %s) = %v, want %v", c.resource, c.prefix, got, c.want)
		}
	}
	// KMS v2: the key id must match too.
	kms := Key{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: "sha256:aa"}
	m.setState(MigrationState{Running: &Migration{Resource: "secrets", Target: kms}})
	if !m.InventoriesTo("secrets", kms.StoredPrefix(), "sha256:aa") || m.InventoriesTo("secrets", kms.StoredPrefix(), "sha256:bb") {
		t.Error("KMS v2 target: only the running key id is the migrator's")
	}

	// Verified at revision 100: the migrator's until an inventory of revision ≥ 100 is
	// stored (refreshInventory adopts the re-scan, or takes one).
	store.Set(&migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 40, WritePrefix: prefix1}}})
	m.setState(MigrationState{Records: map[string]Record{"secrets": {Target: key2, Verified: true, Revision: 100}}})
	if !m.InventoriesTo("secrets", prefix2, "") {
		t.Error("verified, not adopted yet: the change must wait for the adoption")
	}
	store.Set(&migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 100, WritePrefix: prefix2}}})
	if m.InventoriesTo("secrets", prefix2, "") {
		t.Error("re-scan adopted: nothing left to wait for")
	}
	store.Set(&migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 40, WritePrefix: prefix1}}})
	for name, rec := range map[string]Record{
		"unverified":     {Target: key2, Revision: 100},
		"failed":         {Target: key2, Revision: 100, Error: "etcdserver: request timed out"},
		"no revision":    {Target: key2, Verified: true},
		"another target": {Target: Key{Provider: transformers.ProviderAESGCM, Key: "key3"}, Verified: true, Revision: 100},
	} {
		m.setState(MigrationState{Records: map[string]Record{"secrets": rec}})
		if m.InventoriesTo("secrets", prefix2, "") {
			t.Errorf("%s record: the change must be the controller's", name)
		}
	}
}
