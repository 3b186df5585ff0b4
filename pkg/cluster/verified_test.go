package cluster

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// TestFollowerAdoptsTheLeadersReScan: after a verified migration, a follower with the
// leader's configuration takes the leader's verifying re-scan as its inventory (read at
// the record's own revision, which no scan of its own could be: the record was written
// after it); a follower with another configuration reads the objects itself.
func TestFollowerAdoptsTheLeadersReScan(t *testing.T) {
	cli, a, b := startPair(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	storeSecrets(t, cli, a, 30, "/registry/secrets/ns/s%02d")
	storeA, storeB := &migrate.InventoryStore{}, &migrate.InventoryStore{}
	hashOf := func(m *member) func() string { return func() string { return m.agent.ActiveConfig().Hash } }
	migA, _, doneA := startMigratorWith(t, ctx, cli, a, MigratorOptions{Inventory: storeA, ConfigHash: hashOf(a)})
	eventually(t, "a leads", func() bool { _, l := migA.State(); return l })
	migB, _, doneB := startMigratorWith(t, ctx, cli, b, MigratorOptions{Inventory: storeB, ConfigHash: hashOf(b)})
	// The leader's first migration (to k1, at start) must be behind b before the
	// configuration changes: a b still catching up with it then finds its re-scan
	// classified against another configuration and reads the objects itself, and that
	// scan, younger than the next record, passed for b's inventory of it (a flake of a
	// race-detector run).
	eventually(t, "b's inventory after the first migration", func() bool {
		st, _ := migB.State()
		rec := st.Records["secrets"]
		ri := storeB.Latest().Find("secrets")
		return rec.Verified && rec.Target.Key == "k1" && ri != nil && ri.Revision >= rec.Revision
	})

	rotate := func(target, configA, configB string) Record {
		t.Helper()
		for _, c := range []struct {
			m       *member
			content string
		}{{a, configA}, {b, configB}} {
			writeFile(t, c.m.path, c.content)
			if err := c.m.agent.Reload(ctx); err != nil {
				t.Fatal(err)
			}
		}
		var rec Record
		eventually(t, "every object on "+target+", verified, and b's inventory after it", func() bool {
			st, _ := migB.State()
			rec = st.Records["secrets"]
			ri := storeB.Latest().Find("secrets")
			return rec.Verified && rec.Target.Key == target && ri != nil && ri.Revision >= rec.Revision
		})
		return rec
	}

	rec := rotate("k2", secretsConfig("k2", "k1"), secretsConfig("k2", "k1"))
	ri := storeB.Latest().Find("secrets")
	if ri.Revision != rec.Revision {
		t.Errorf("b's inventory was read at revision %d, not the record's %d: b scanned instead of adopting the leader's re-scan", ri.Revision, rec.Revision)
	}
	if ri.Objects != 30 || ri.Stale != 0 || len(ri.Buckets) != 1 || ri.Buckets[0].Key != "k2" {
		t.Errorf("b's adopted inventory: %d objects, %d stale, buckets %+v; want 30 on k2", ri.Objects, ri.Stale, ri.Buckets)
	}
	if la := storeA.Latest().Find("secrets"); la == nil || la.Revision != ri.Revision {
		t.Errorf("a's inventory %+v, b's at revision %d: want the same re-scan", la, ri.Revision)
	}

	// The configurations differ (b keeps k1 for reads): b classifies as a does not, so it
	// reads the objects itself.
	rec = rotate("k3", secretsConfig("k3", "k2"), secretsConfig("k3", "k2", "k1"))
	ri = storeB.Latest().Find("secrets")
	if ri.Revision <= rec.Revision {
		t.Errorf("b's inventory was read at revision %d, the record's is %d: b adopted a re-scan of another configuration", ri.Revision, rec.Revision)
	}
	if ri.Objects != 30 || ri.Stale != 0 {
		t.Errorf("b's own inventory: %d objects, %d stale; want 30, none stale", ri.Objects, ri.Stale)
	}
	cancel()
	<-doneA
	<-doneB
}

// TestAdoptVerifiedRefuses: the stored re-scan is adopted only for its record, its
// configuration and when it is whole; the reasons say which.
func TestAdoptVerifiedRefuses(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	key := coordination.MigrationVerified(defaultPrefix, "secrets")
	put := func(v verifiedInventory) {
		t.Helper()
		data, err := json.Marshal(v)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(data)); err != nil {
			t.Fatal(err)
		}
	}
	rec := Record{Verified: true, Revision: 42}
	if inv, why := adoptVerified(ctx, cli, defaultPrefix, "secrets", rec, "h1"); inv != nil || !strings.Contains(why, "no re-scan") {
		t.Errorf("no key: %v, %q", inv, why)
	}
	good := verifiedInventory{ConfigHash: "h1", DecryptChecked: true,
		Resource:   migrate.ResourceInventory{Resource: "secrets", Revision: 42, Objects: 2, Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: "kms", Key: "p"}, Objects: 2}}},
		SampleKeys: []string{"/registry/secrets/ns/a"}}
	put(good)
	inv, why := adoptVerified(ctx, cli, defaultPrefix, "secrets", rec, "h1")
	if inv == nil {
		t.Fatalf("the matching re-scan was refused: %s", why)
	}
	if got := inv.Find("secrets"); got == nil || got.Buckets[0].SampleKey != "/registry/secrets/ns/a" || !inv.DecryptChecked {
		t.Errorf("adopted %+v: want the bucket's sample key and the decrypt check kept", inv)
	}
	for _, c := range []struct {
		what string
		rec  Record
		hash string
		v    *verifiedInventory
		want string
	}{
		{"another record", Record{Verified: true, Revision: 43}, "h1", nil, "revision 42, the record's is 43"},
		{"another configuration", rec, "h2", nil, "another configuration"},
		{"no configuration hash", rec, "", nil, "another configuration"},
		{"sample keys of other buckets", rec, "h1", &verifiedInventory{ConfigHash: "h1", Resource: good.Resource, SampleKeys: []string{"x", "y"}}, "2 sample keys for 1 buckets"},
	} {
		if c.v != nil {
			put(*c.v)
		}
		if inv, why := adoptVerified(ctx, cli, defaultPrefix, "secrets", c.rec, c.hash); inv != nil || !strings.Contains(why, c.want) {
			t.Errorf("%s: adopted %v, reason %q; want refused with %q", c.what, inv != nil, why, c.want)
		}
	}
	if _, err := cli.Put(ctx, key, "{"); err != nil {
		t.Fatal(err)
	}
	if inv, why := adoptVerified(ctx, cli, defaultPrefix, "secrets", rec, "h1"); inv != nil || !strings.Contains(why, "does not decode") {
		t.Errorf("garbage: %v, %q", inv, why)
	}
}
