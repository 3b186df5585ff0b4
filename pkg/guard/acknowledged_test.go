package guard

import (
	"context"
	"strings"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestGuardLetsAKeyGoUnderAcknowledgedObjectsOnly: key0 still "holds" one object, but
// no configuration reads it (it was written with another secret named key0). Until it
// is acknowledged, dropping key0 is refused; acknowledged, the drop passes; a second,
// unacknowledged one blocks again, and the refusal says how many are acknowledged and
// how to acknowledge the rest.
func TestGuardLetsAKeyGoUnderAcknowledgedObjectsOnly(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Start(t).Client(t)
	const coordination = "/rekey"
	current, cur := setFor(t, "secrets", "aesgcm:key1", "aesgcm:key0")
	next, _ := setFor(t, "secrets", "aesgcm:key1")
	_, impostor := setFor(t, "secrets", "aesgcm:key0=other")
	_, old := setFor(t, "secrets", "aesgcm:key0")
	res := migrate.ResourceFor(migrate.DefaultEtcdPrefix, secrets)
	writeObjects(t, cli, cur, secrets, 3)
	plantWith := func(set *transformers.Set, ns, name string) {
		key := res.KeyPrefix + ns + "/" + name
		stored, err := set.TransformerFor(secrets).TransformToStorage(ctx, enctest.PlaintextFor(key, 0), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(stored)); err != nil {
			t.Fatal(err)
		}
	}
	inventory := func() *migrate.Inventory {
		inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(cur), Resources: []migrate.Resource{res},
			DecryptCheck: true, CoordinationPrefix: coordination})
		if err != nil {
			t.Fatal(err)
		}
		return inv
	}
	plantWith(impostor, "team-a", "lost")

	vs := CheckChange(inventory(), current, next)
	if len(vs) != 1 || vs[0].Objects != 1 || !strings.Contains(vs[0].String(), "0 of them are acknowledged") ||
		!strings.Contains(vs[0].String(), "rekey migrate --acknowledge-unreadable secrets/<namespace>/<name>") {
		t.Fatalf("violations before the acknowledgement: %v", vs)
	}

	acker := migrate.Acknowledger{Client: cli, Source: migrate.FromSet(cur), CoordinationPrefix: coordination}
	if _, err := acker.Acknowledge(ctx, res, "team-a", "lost", "its data was recreated"); err != nil {
		t.Fatal(err)
	}
	if vs := CheckChange(inventory(), current, next); len(vs) != 0 {
		t.Fatalf("dropping key0 with only an acknowledged unreadable object under it: %v", vs)
	}

	plantWith(impostor, "team-b", "also-lost")
	vs = CheckChange(inventory(), current, next)
	if len(vs) != 1 || vs[0].Objects != 2 || !strings.Contains(vs[0].String(), "1 of them are acknowledged unreadable objects and 1 more are unreadable") {
		t.Fatalf("violations with a second, unacknowledged object: %v", vs)
	}

	// A readable object under key0 needs a migration, whatever is acknowledged.
	plantWith(old, "team-c", "readable")
	if _, err := cli.Delete(ctx, res.KeyPrefix+"team-b/also-lost"); err != nil {
		t.Fatal(err)
	}
	vs = CheckChange(inventory(), current, next)
	if len(vs) != 1 || !strings.Contains(vs[0].String(), "1 are readable and need a migration") {
		t.Fatalf("violations with a readable object under key0: %v", vs)
	}
}
