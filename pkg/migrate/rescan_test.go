package migrate

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// putWith stores the object at key encrypted with tr, its plaintext of generation gen.
func putWith(t *testing.T, cli *clientv3.Client, tr value.Transformer, key string, gen int) {
	t.Helper()
	ctx := context.Background()
	stored, err := tr.TransformToStorage(ctx, plaintextFor(key, gen), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, key, string(stored)); err != nil {
		t.Fatal(err)
	}
}

// comparable strips what differs between two scans of the same objects (when and at
// which revision they ran, what the re-scan carried) and checks that every KMS v2
// bucket names a sample in both.
func comparable(t *testing.T, inv *Inventory) string {
	t.Helper()
	var b strings.Builder
	for _, r := range inv.Resources {
		r.Revision, r.Carried = 0, 0
		for i := range r.Buckets {
			if r.Buckets[i].Provider == transformers.ProviderKMSv2 && r.Buckets[i].SampleKey == "" {
				t.Errorf("%s: KMS v2 bucket %+v has no sample key", r.Resource, r.Buckets[i].Bucket)
			}
			r.Buckets[i].SampleKey = ""
		}
		fmt.Fprintf(&b, "%+v\n", r)
	}
	return b.String()
}

// TestRescanCountsWhatAWholeScanCounts: when the migration's verifying re-scan starts,
// clients have changed what it wrote in every way the re-scan must notice: objects
// updated here and there (read one by one), most of one page rewritten (read as a
// span), objects deleted and created, and one written with the old key (so a second
// pass runs). The verified inventory must equal a whole scan's of the same store,
// bucket for bucket and byte for byte, and still have counted most objects from the
// migration's own writes without reading them.
func TestRescanCountsWhatAWholeScanCounts(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets, configmaps", "aesgcm:key1")
	keys := writeObjects(t, cli, old, secrets, 1000)
	writeObjects(t, cli, old, configmaps, 50)
	_, next := setFor(t, "secrets, configmaps", "aesgcm:key2,key1")
	tr := next.TransformerFor(secrets)

	// Keys in etcd's order, so that most of one page of the re-scan is changed.
	ordered := slices.Clone(keys)
	slices.Sort(ordered)
	touched := map[string]bool{}
	changed := false
	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 100, BatchSize: 16,
		Progress: func(p Progress) {
			if p.Phase != "verify" || changed {
				return
			}
			changed = true
			for i := 3; i < len(keys); i += 97 {
				putWith(t, cli, tr, keys[i], 1)
				touched[keys[i]] = true
			}
			for _, k := range ordered[500:580] {
				putWith(t, cli, tr, k, 2)
				touched[k] = true
			}
			for _, i := range []int{11, 12, 300, 801, 999} {
				if _, err := cli.Delete(ctx, keys[i]); err != nil {
					t.Fatal(err)
				}
				touched[keys[i]] = true
			}
			for i := range 3 {
				putWith(t, cli, tr, keyOf(secrets, "ns-new", fmt.Sprintf("created-%d", i)), 0)
			}
			putWith(t, cli, old.TransformerFor(secrets), keys[42], 3)
			delete(touched, keys[42]) // the second pass rewrites it
		}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Passes != 2 {
		t.Fatalf("passes = %d, want 2 (the object written with the old key during the first re-scan)", res.Passes)
	}
	full, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources(), DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := comparable(t, res.Verified), comparable(t, full); got != want {
		t.Fatalf("verified re-scan:\n%s\nwhole scan of the same store:\n%s", got, want)
	}
	ri := res.Verified.Find("secrets")
	if ri.Objects != 998 || ri.Stale != 0 {
		t.Fatalf("secrets: %d objects, %d stale; want 998, 0", ri.Objects, ri.Stale)
	}
	// Every Secret the migration wrote and nobody touched since, the one the second
	// pass rewrote included; not the created ones.
	if want := int64(1000 - len(touched)); ri.Carried != want {
		t.Fatalf("secrets: %d of %d objects carried from the migration's writes, want %d", ri.Carried, ri.Objects, want)
	}
	if cm := res.Verified.Find("configmaps"); cm.Carried != 50 {
		t.Fatalf("configmaps: %d carried, want all 50 (nothing changed them)", cm.Carried)
	}
}

// TestRescanCarriesKMSv2Buckets: a migration to KMS v2 carries its writes into the
// plugin's buckets, each with a sample key the decrypt guard can read.
func TestRescanCarriesKMSv2Buckets(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	kms := startKMS(t, "key-a")
	_, old := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, old, secrets, 200)
	rule := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	next := buildReady(t, rule+kms.ProviderYAML("plug")+providerYAML("aesgcm:key1"), kms.Factory)
	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources()[:1], BatchSize: 32})
	if err != nil {
		t.Fatal(err)
	}
	full, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources()[:1], DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	if got, want := comparable(t, res.Verified), comparable(t, full); got != want {
		t.Fatalf("verified re-scan:\n%s\nwhole scan:\n%s", got, want)
	}
	if ri := res.Verified.Find("secrets"); ri.Carried != 200 {
		t.Fatalf("carried %d, want 200", ri.Carried)
	}
}

// TestRescanIgnoresALedgerOfAnotherConfiguration: a ledger is only good for the
// classification it was recorded under, and for the etcd it was written to while that
// etcd's revisions have not gone back. Otherwise the re-scan reads every value.
func TestRescanIgnoresALedgerOfAnotherConfiguration(t *testing.T) {
	_, a := setFor(t, "secrets", "aesgcm:key2,key1")
	_, b := setFor(t, "secrets", "aesgcm:key2,key1,key3")
	l := newWriteLedger()
	name := testResources()[0].String()
	clOf := func(s *transformers.Set) *classifier {
		src := FromSet(s)
		return newClassifier(src.Rule(secrets), src.KnownPrefixes())
	}
	l.begin(name, clOf(a))
	now := &etcdserverpb.ResponseHeader{ClusterId: 1, Revision: 100}
	key := keyOf(secrets, "ns", "x")
	stored, err := a.TransformerFor(secrets).TransformToStorage(context.Background(), plaintextFor(key, 0), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	l.record(name, 1, 7, []rewrite{{key: []byte(key), val: stored, readBack: true}})
	if _, ok := l.forScan(name, clOf(a), now); !ok {
		t.Fatal("the ledger is not used by a re-scan of the configuration it was recorded under")
	}
	if _, ok := l.forScan(name, clOf(b), now); ok {
		t.Fatal("a re-scan with another key known used the ledger recorded without it")
	}
	if _, ok := l.forScan(name, clOf(a), &etcdserverpb.ResponseHeader{ClusterId: 2, Revision: 100}); ok {
		t.Fatal("a re-scan of another etcd cluster used the ledger")
	}
	if _, ok := l.forScan(name, clOf(a), &etcdserverpb.ResponseHeader{ClusterId: 1, Revision: 6}); ok {
		t.Fatal("a re-scan of a store whose revision went back below the ledger's (a restore) used it")
	}
	// A transaction written with a key the pass did not start with is not recorded.
	_, c := setFor(t, "secrets", "aesgcm:key3,key2,key1")
	stored, err = c.TransformerFor(secrets).TransformToStorage(context.Background(), plaintextFor(key, 0), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	l.record(name, 1, 8, []rewrite{{key: []byte(key), val: stored, readBack: true}})
	if ours, _ := l.forScan(name, clOf(a), now); ours.txns[8] != nil {
		t.Fatal("a value under a key the pass's configuration does not know was recorded as current")
	}
	l.record(name, 1, 9, []rewrite{{key: []byte(key), val: stored, readBack: false}})
	if ours, _ := l.forScan(name, clOf(a), now); ours.txns[9] != nil {
		t.Fatal("a value not read back was recorded")
	}
}

// brokenWrites writes values its reads reject (a write provider whose key cannot
// decrypt what it encrypts).
type brokenWrites struct{ rt value.ResourceTransformers }

func (b brokenWrites) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return brokenWriter{b.rt.TransformerForResource(gr)}
}

type brokenWriter struct{ value.Transformer }

func (w brokenWriter) TransformToStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, error) {
	out, err := w.Transformer.TransformToStorage(ctx, data, dataCtx)
	if err == nil {
		out[len(out)-1] ^= 0xff
	}
	return out, err
}

// TestMigrationNeverWritesWhatItCannotReadBack: every re-encrypted value is decrypted
// back before it is swapped in; one that fails is an error and nothing is written.
func TestMigrationNeverWritesWhatItCannotReadBack(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, old, secrets, 20)
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	revBefore := currentRev(t, cli)
	src := FromRules(brokenWrites{setTransformers{next}}, next.Rules)
	_, err := Migrate(ctx, Options{Client: cli, Source: src, Resources: testResources()[:1]})
	if err == nil || !strings.Contains(err.Error(), "cannot be read back") {
		t.Fatalf("err = %v, want the written value cannot be read back", err)
	}
	if rev := currentRev(t, cli); rev != revBefore {
		t.Fatalf("the migration wrote to etcd (revision %d → %d) values it could not read back", revBefore, rev)
	}
}
