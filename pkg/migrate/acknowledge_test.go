package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/testutil"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/transformers"
)

const testCoordination = "/rekey"

// plant stores the object at key encrypted with set (a configuration the one under test
// may not read) and returns its mod revision.
func plant(t testing.TB, cli *clientv3.Client, set *transformers.Set, key string) int64 {
	t.Helper()
	ctx := context.Background()
	stored, err := set.TransformerFor(secrets).TransformToStorage(ctx, plaintextFor(key, 0), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	resp, err := cli.Put(ctx, key, string(stored))
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

// TestAcknowledgedUnreadableObject: an object written with a key the configuration no
// longer has keeps a migration unverified; acknowledged, the migration verifies except
// it; a second, unacknowledged one still blocks; a rewrite of the acknowledged one
// voids its acknowledgement.
func TestAcknowledgedUnreadableObject(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key0")
	_, gone := setFor(t, "secrets", "aesgcm:gone")
	_, cur := setFor(t, "secrets", "aesgcm:key1", "aesgcm:key0")
	res := ResourceFor(DefaultEtcdPrefix, secrets)
	writeObjects(t, cli, old, secrets, 5)
	lost := keyOf(secrets, "team-a", "lost")
	plant(t, cli, gone, lost)

	opts := Options{Client: cli, Source: FromSet(cur), Resources: []Resource{res}, CoordinationPrefix: testCoordination}
	if _, err := Migrate(ctx, opts); !errors.Is(err, ErrNotFinished) || !strings.Contains(err.Error(), "--acknowledge-unreadable") {
		t.Fatalf("migration with an unacknowledged unreadable object: %v, want ErrNotFinished naming --acknowledge-unreadable", err)
	}

	// The inventory names it: namespace, name, stored prefix and class, nothing else.
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(cur), Resources: []Resource{res}, DecryptCheck: true, CoordinationPrefix: testCoordination})
	if err != nil {
		t.Fatal(err)
	}
	ri := inv.Find("secrets")
	if len(ri.UnreadableObjects) != 1 {
		t.Fatalf("unreadable objects = %+v, want the planted one", ri.UnreadableObjects)
	}
	got := ri.UnreadableObjects[0]
	want := UnreadableObject{Key: lost, Namespace: "team-a", Name: "lost", Prefix: "k8s:enc:aesgcm:v1:gone:", Class: ClassUnknownKey, ModRevision: got.ModRevision}
	if got != want || got.ModRevision == 0 {
		t.Fatalf("unreadable object = %+v, want %+v", got, want)
	}

	// Readable and missing objects are refused.
	acker := Acknowledger{Client: cli, Source: FromSet(cur), CoordinationPrefix: testCoordination}
	const reason = "restored from backup elsewhere"
	if _, err := acker.Acknowledge(ctx, res, "ns0", "obj-000000", reason); !errors.Is(err, ErrReadable) {
		t.Fatalf("acknowledging a readable object: %v, want ErrReadable", err)
	}
	if _, err := acker.Acknowledge(ctx, res, "team-a", "nope", reason); err == nil || !strings.Contains(err.Error(), "no object is stored there") {
		t.Fatalf("acknowledging a missing object: %v", err)
	}
	if _, err := acker.Acknowledge(ctx, res, "team-a", "lost", ""); err == nil || !strings.Contains(err.Error(), "--reason") {
		t.Fatalf("acknowledging without a reason: %v", err)
	}

	ack, err := acker.Acknowledge(ctx, res, "team-a", "lost", reason)
	if err != nil {
		t.Fatal(err)
	}
	if ack.By != DefaultAcknowledgedBy || ack.Class != ClassUnknownKey || ack.ModRevision != got.ModRevision || ack.Prefix != want.Prefix {
		t.Fatalf("acknowledgement = %+v", ack)
	}
	stored, err := cli.Get(ctx, acknowledgementKey(testCoordination, res, lost))
	if err != nil || len(stored.Kvs) != 1 {
		t.Fatalf("acknowledgement at %s: %v %v", acknowledgementKey(testCoordination, res, lost), stored, err)
	}
	if k := string(stored.Kvs[0].Key); k != "/rekey/acknowledged/secrets/team-a/lost" {
		t.Fatalf("acknowledgement key = %q", k)
	}

	// (a) verified except 1 acknowledged.
	result, err := Migrate(ctx, opts)
	if err != nil {
		t.Fatalf("migration with the unreadable object acknowledged: %v", err)
	}
	if result.Acknowledged != 1 || result.Verified.Find("secrets").Blocking() != 0 || result.Verified.TotalStale() != 0 {
		t.Fatalf("result: acknowledged %d, verified %+v", result.Acknowledged, result.Verified.Find("secrets"))
	}

	// (c) a second, unacknowledged one still blocks, and only it is named.
	second := keyOf(secrets, "team-b", "also-lost")
	plant(t, cli, gone, second)
	_, err = Migrate(ctx, opts)
	if !errors.Is(err, ErrNotFinished) || !strings.Contains(err.Error(), "1 objects cannot be decrypted") ||
		!strings.Contains(err.Error(), second) || strings.Contains(err.Error(), lost) || !strings.Contains(err.Error(), "1 more are acknowledged") {
		t.Fatalf("migration with a second unreadable object: %v", err)
	}
	if _, err := cli.Delete(ctx, second); err != nil {
		t.Fatal(err)
	}

	// (d) rewriting the acknowledged object voids the acknowledgement.
	plant(t, cli, gone, lost)
	if _, err := Migrate(ctx, opts); !errors.Is(err, ErrNotFinished) || !strings.Contains(err.Error(), lost) {
		t.Fatalf("migration after the acknowledged object was rewritten: %v, want it to block again", err)
	}

	// The void acknowledgement is gone: the migration's inventory collected it.
	acks, err := loadAcknowledgements(ctx, cli, testCoordination)
	if err != nil || len(acks.Sorted()) != 0 {
		t.Fatalf("acknowledgements after the object was rewritten = %v, %v; want none", acks, err)
	}
	if stored, err := cli.Get(ctx, acknowledgementKey(testCoordination, res, lost)); err != nil || len(stored.Kvs) != 0 {
		t.Fatalf("the void acknowledgement is still stored: %v %v", stored, err)
	}

	// Acknowledged again (its new value), then removed.
	if _, err := acker.Acknowledge(ctx, res, "team-a", "lost", reason); err != nil {
		t.Fatal(err)
	}
	if acks, err := loadAcknowledgements(ctx, cli, testCoordination); err != nil || len(acks.Sorted()) != 1 {
		t.Fatalf("acknowledgements = %v, %v", acks, err)
	}
	if removed, err := acker.Remove(ctx, res, "team-a", "lost"); err != nil || !removed {
		t.Fatalf("remove = %v, %v", removed, err)
	}
	if removed, err := acker.Remove(ctx, res, "team-a", "lost"); err != nil || removed {
		t.Fatalf("second remove = %v, %v", removed, err)
	}
}

// TestUnreadableClasses: the classes an inventory with a decrypt check tells apart.
func TestUnreadableClasses(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, cur := setFor(t, "secrets", "aesgcm:key1")
	_, gone := setFor(t, "secrets", "aesgcm:gone")
	_, otherSecret := setFor(t, "secrets", "aesgcm:key1=other")
	plant(t, cli, gone, keyOf(secrets, "ns", "unknown"))
	plant(t, cli, otherSecret, keyOf(secrets, "ns", "wrong-secret"))
	// A cluster-scoped name: no namespace in the key.
	plant(t, cli, gone, ResourceFor(DefaultEtcdPrefix, secrets).KeyPrefix+"cluster-wide")
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(cur), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)}, DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, o := range inv.Find("secrets").UnreadableObjects {
		got[o.Namespace+"/"+o.Name] = o.Class + " " + o.Prefix
	}
	want := map[string]string{
		"ns/unknown":      ClassUnknownKey + " k8s:enc:aesgcm:v1:gone:",
		"ns/wrong-secret": ClassDecryptFailed + " k8s:enc:aesgcm:v1:key1:",
		"/cluster-wide":   ClassUnknownKey + " k8s:enc:aesgcm:v1:gone:",
	}
	if fmt.Sprint(got) != fmt.Sprint(want) {
		t.Fatalf("classes = %v, want %v", got, want)
	}
}

// TestUnreadableListIsBounded: the inventory counts every unreadable object but names
// only the first MaxUnreadableListed.
func TestUnreadableListIsBounded(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, cur := setFor(t, "secrets", "aesgcm:key1")
	const n = MaxUnreadableListed + 5
	var ops []clientv3.Op
	for i := 0; i < n; i++ {
		ops = append(ops, clientv3.OpPut(keyOf(secrets, "ns", fmt.Sprintf("o%05d", i)), "k8s:enc:aesgcm:v1:gone:xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx"))
		if len(ops) == 100 || i == n-1 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
	}
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(cur), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)}})
	if err != nil {
		t.Fatal(err)
	}
	ri := inv.Find("secrets")
	if ri.Unreadable != n || len(ri.UnreadableObjects) != MaxUnreadableListed || len(ri.UnreadableKeys) != maxUnreadableSamples {
		t.Fatalf("unreadable %d, listed %d, sampled %d", ri.Unreadable, len(ri.UnreadableObjects), len(ri.UnreadableKeys))
	}
}

// TestAcknowledgedMetric: the inventory's acknowledged count is exported per resource.
func TestAcknowledgedMetric(t *testing.T) {
	reg := metrics.NewKubeRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	m.recordInventory(&Inventory{Resources: []ResourceInventory{{Resource: "secrets", Unreadable: 2, Acknowledged: 1}}})
	want := `
# HELP rekey_storage_unreadable_acknowledged_objects [ALPHA] Unreadable stored objects an operator acknowledged, per resource, from the latest inventory: they no longer keep a migration unverified or a key in use.
# TYPE rekey_storage_unreadable_acknowledged_objects gauge
rekey_storage_unreadable_acknowledged_objects{resource="secrets"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "rekey_storage_unreadable_acknowledged_objects"); err != nil {
		t.Fatal(err)
	}
}

// pageKV records the largest page a range read returned, and how many there were.
type pageKV struct {
	clientv3.KV
	reads, largest int
}

func (k *pageKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.reads++
		k.largest = max(k.largest, len(resp.Kvs))
	}
	return resp, err
}

// TestVoidAcknowledgementsAreCollected: acknowledgements are read in bounded pages;
// those whose object was rewritten or deleted since are deleted, the others (and a
// record that does not decode) stay; a void one recorded again after it was read is
// not deleted.
func TestVoidAcknowledgementsAreCollected(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, gone := setFor(t, "secrets", "aesgcm:gone")
	_, cur := setFor(t, "secrets", "aesgcm:key1")
	res := ResourceFor(DefaultEtcdPrefix, secrets)
	names := []string{"a", "b", "c", "d", "e"}
	for _, name := range names {
		plant(t, cli, gone, keyOf(secrets, "ns", name))
		acker := Acknowledger{Client: cli, Source: FromSet(cur), CoordinationPrefix: testCoordination}
		if _, err := acker.Acknowledge(ctx, res, "ns", name, "lost with the old key"); err != nil {
			t.Fatal(err)
		}
	}
	garbage := coordination.AcknowledgedPrefix(testCoordination) + "secrets/ns/zz"
	if _, err := cli.Put(ctx, garbage, "{not json"); err != nil {
		t.Fatal(err)
	}
	plant(t, cli, gone, keyOf(secrets, "ns", "b")) // rewritten
	if _, err := cli.Delete(ctx, keyOf(secrets, "ns", "d")); err != nil {
		t.Fatal(err)
	}

	kv := &pageKV{KV: cli.KV}
	got, err := collectAcknowledgements(ctx, kv, testCoordination, 2)
	if err != nil || got.DeleteErr != nil {
		t.Fatalf("collect: %v, %v", err, got.DeleteErr)
	}
	if kv.largest > 2 || kv.reads < 3 {
		t.Errorf("6 records in pages of 2: %d range reads, the largest of %d records", kv.reads, kv.largest)
	}
	var inForce, deleted []string
	for _, a := range got.InForce.Sorted() {
		inForce = append(inForce, a.Name)
	}
	for _, a := range got.Deleted {
		deleted = append(deleted, a.Name)
	}
	if strings.Join(inForce, ",") != "a,c,e" || strings.Join(deleted, ",") != "b,d" {
		t.Fatalf("in force %v, deleted %v; want a,c,e and b,d", inForce, deleted)
	}
	resp, err := cli.Get(ctx, coordination.AcknowledgedPrefix(testCoordination), clientv3.WithPrefix(), clientv3.WithKeysOnly())
	if err != nil {
		t.Fatal(err)
	}
	var stored []string
	for _, kv := range resp.Kvs {
		stored = append(stored, strings.TrimPrefix(string(kv.Key), coordination.AcknowledgedPrefix(testCoordination)))
	}
	if want := "secrets/ns/a,secrets/ns/c,secrets/ns/e,secrets/ns/zz"; strings.Join(stored, ",") != want {
		t.Fatalf("stored acknowledgements %v, want %s", stored, want)
	}

	// A void acknowledgement read before it was recorded again stays.
	plant(t, cli, gone, keyOf(secrets, "ns", "c")) // c is now void...
	key := acknowledgementKey(testCoordination, res, keyOf(secrets, "ns", "c"))
	before, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	var stale Acknowledgement
	if err := json.Unmarshal(before.Kvs[0].Value, &stale); err != nil {
		t.Fatal(err)
	}
	acker := Acknowledger{Client: cli, Source: FromSet(cur), CoordinationPrefix: testCoordination}
	if _, err := acker.Acknowledge(ctx, res, "ns", "c", "still lost"); err != nil { // ...and acknowledged again
		t.Fatal(err)
	}
	c := CollectedAcknowledgements{InForce: Acknowledgements{}}
	if err := c.sortPage(ctx, cli, []ackRecord{{ack: stale, key: key, rev: before.Kvs[0].ModRevision}}); err != nil || len(c.Deleted) != 0 {
		t.Fatalf("collecting an acknowledgement recorded again since it was read: deleted %v, %v", c.Deleted, err)
	}
	if acks, err := loadAcknowledgements(ctx, cli, testCoordination); err != nil || !acks.Covers(keyOf(secrets, "ns", "c"), acks[keyOf(secrets, "ns", "c")].ModRevision) || len(acks) != 3 {
		t.Fatalf("acknowledgements after c was acknowledged again = %v, %v; want a, c, e", acks, err)
	}
}
