package migrate

import (
	"context"
	"fmt"
	"reflect"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"k8s.io/apiserver/pkg/storage/value"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// scanOf tallies kvs as a scan classifying with cl would.
func scanOf(kvs []*mvccpb.KeyValue, cl *classifier) ResourceInventory {
	t := newTally(ResourceFor(DefaultEtcdPrefix, secrets), cl, nil, false)
	for _, kv := range kvs {
		t.add(kv, checkResult{})
	}
	return *t.inventory(7)
}

// TestRelabelAgreesWithAScan: whenever relabelling answers, it answers what a scan
// with the new configuration would (stale counts, buckets, write target, unreadable
// objects); where the buckets cannot say, it refuses, and the controller scans.
func TestRelabelAgreesWithAScan(t *testing.T) {
	ctx := context.Background()
	encrypt := func(providers []string, name string) *mvccpb.KeyValue {
		_, set := setFor(t, "secrets", providers...)
		key := keyOf(secrets, "ns", name)
		out, err := set.TransformerFor(secrets).TransformToStorage(ctx, plaintextFor(key, 1), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		return &mvccpb.KeyValue{Key: []byte(key), Value: out, ModRevision: 3}
	}
	k1 := []string{"aesgcm:key1"}
	stored := []*mvccpb.KeyValue{
		encrypt(k1, "a"), encrypt(k1, "b"), encrypt(k1, "c"),
		encrypt([]string{"aesgcm:key2"}, "d"),
		encrypt([]string{"identity"}, "plain"),
		{Key: []byte(keyOf(secrets, "ns", "ghost")), Value: []byte("k8s:enc:aesgcm:v1:ghost:ciphertext"), ModRevision: 4},
	}
	classifierOf := func(providers ...string) *classifier {
		_, set := setFor(t, "secrets", providers...)
		src := FromSet(set)
		return newClassifier(src.Rule(secrets), src.KnownPrefixes())
	}
	for _, c := range []struct {
		name     string
		from, to []string
		answers  bool
	}{
		{"a new write key (promotion)", []string{"aesgcm:key1,key2", "identity"}, []string{"aesgcm:key2,key1", "identity"}, true},
		{"back to plaintext", []string{"aesgcm:key1,key2", "identity"}, []string{"identity", "aesgcm:key1,key2"}, true},
		{"to another provider", []string{"aesgcm:key1,key2", "identity"}, []string{"secretbox:key3", "aesgcm:key1,key2", "identity"}, true},
		{"a stored key removed", []string{"aesgcm:key1,key2", "identity"}, []string{"aesgcm:key2", "identity"}, false},
		{"plaintext no longer read", []string{"aesgcm:key1,key2", "identity"}, []string{"aesgcm:key2,key1"}, false},
		{"an unknown stored key now known", []string{"aesgcm:key1,key2", "identity"}, []string{"aesgcm:key2,key1,ghost", "identity"}, false},
	} {
		t.Run(c.name, func(t *testing.T) {
			before := scanOf(stored, classifierOf(c.from...))
			clNew := classifierOf(c.to...)
			got, ok := relabelResource(before, clNew)
			if ok != c.answers {
				t.Fatalf("relabel answered %v, want %v", ok, c.answers)
			}
			if !ok {
				return
			}
			want := scanOf(stored, clNew)
			if got.WritePrefix != before.WritePrefix || got.WriteKeyIDHash != before.WriteKeyIDHash {
				t.Errorf("relabelled write target %s %s, want the scan's %s %s", got.WritePrefix, got.WriteKeyIDHash, before.WritePrefix, before.WriteKeyIDHash)
			}
			want.WritePrefix, want.WriteKeyIDHash = got.WritePrefix, got.WriteKeyIDHash
			if !reflect.DeepEqual(got, want) {
				t.Errorf("relabelled:\n%+v\na scan with the new configuration:\n%+v", got, want)
			}
		})
	}
}

// TestRelabelKMSKeyIDs: a KMS v2 plugin's new key id makes the values of the old one
// stale, by their key id hash; a key id the scan could not decode keeps them unreadable.
func TestRelabelKMSKeyIDs(t *testing.T) {
	stored := []*mvccpb.KeyValue{
		{Key: []byte("/registry/secrets/ns/a"), Value: []byte(kmsValue("plug", "key-a"))},
		{Key: []byte("/registry/secrets/ns/b"), Value: []byte(kmsValue("plug", "key-a"))},
		{Key: []byte("/registry/secrets/ns/c"), Value: []byte(kmsValue("plug", "key-b"))},
		{Key: []byte("/registry/secrets/ns/d"), Value: []byte("k8s:enc:kms:v2:plug:not-an-encrypted-object")},
	}
	rule := func(keyID string) *classifier {
		const prefix = "k8s:enc:kms:v2:plug:"
		return newClassifier(transformers.RuleInfo{Resource: "secrets", WriteProvider: "kms", WriteKey: "plug", WritePrefix: prefix, ReadPrefixes: []string{prefix},
			KMS: &transformers.KMSStatus{KeyIDHash: sha(keyID), DEKSourceType: "HKDF_SHA256_XNONCE_AES_GCM_SEED"}}, []string{prefix})
	}
	before := scanOf(stored, rule("key-a"))
	if before.Stale != 1 {
		t.Fatalf("scan on key-a: %d stale, want 1 (key-b's)", before.Stale)
	}
	got, ok := relabelResource(before, rule("key-b"))
	if !ok {
		t.Fatal("relabel refused a key id change")
	}
	want := scanOf(stored, rule("key-b"))
	want.WriteKeyIDHash = before.WriteKeyIDHash // the scan's (see relabelResource)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("relabelled:\n%+v\na scan on key-b:\n%+v", got, want)
	}
	if got.Stale != 2 || got.Unreadable != 1 {
		t.Errorf("on key-b: %d stale, %d unreadable; want key-a's 2 stale, the broken one unreadable", got.Stale, got.Unreadable)
	}
}

// TestRelabelRefusesCollapsedBuckets: a resource whose scan collapsed buckets into
// "other" (more stored key names than the bound) cannot be judged by its buckets.
func TestRelabelRefusesCollapsedBuckets(t *testing.T) {
	var stored []*mvccpb.KeyValue
	for i := range maxBucketsPerResource + 2 {
		stored = append(stored, &mvccpb.KeyValue{Key: fmt.Appendf(nil, "/registry/secrets/ns/%d", i), Value: fmt.Appendf(nil, "k8s:enc:aesgcm:v1:ghost%d:x", i)})
	}
	_, set := setFor(t, "secrets", "aesgcm:key1")
	src := FromSet(set)
	cl := newClassifier(src.Rule(secrets), src.KnownPrefixes())
	before := scanOf(stored, cl)
	if before.OtherBuckets == 0 {
		t.Fatalf("the scan collapsed nothing: %d buckets", len(before.Buckets))
	}
	if _, ok := relabelResource(before, cl); ok {
		t.Error("relabel answered for a scan with collapsed buckets")
	}
}

// TestControllerRelabelsOnAWriteKeyChange: with the controller only keeping the
// inventory (no auto-migration), a write key change judges the latest inventory
// again (every object stale at once, the scan's revision kept); etcd is not read: the
// objects written after the scan are not counted until the next periodic scan.
func TestControllerRelabelsOnAWriteKeyChange(t *testing.T) {
	cli := startEtcd(t)
	ctx := context.Background()
	_, set := setFor(t, "secrets", "aesgcm:key1,key2")
	writeObjects(t, cli, set, secrets, 5)
	sw := &swappable{}
	sw.cur.Store(set)
	src := FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	clk := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	ctrl := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], Clock: clk, CheckInterval: time.Second, InventoryInterval: time.Hour, Logger: testLogger(t)})
	ctrl.check(ctx)
	first := ctrl.Inventory().Latest()
	if ri := first.Find("secrets"); ri == nil || ri.Objects != 5 || ri.Stale != 0 {
		t.Fatalf("first inventory: %+v", first)
	}
	// One more object, then the write key changes.
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	writeObjects(t, cli, set, secrets, 6)
	sw.cur.Store(next)
	clk.Step(time.Second)
	ctrl.check(ctx)
	inv := ctrl.Inventory().Latest()
	ri := inv.Find("secrets")
	if inv.RelabelledAt.IsZero() || ri.Revision != first.Find("secrets").Revision {
		t.Fatalf("after the write key change: relabelled at %v, revision %d (first %d); want the first scan judged again", inv.RelabelledAt, ri.Revision, first.Find("secrets").Revision)
	}
	if ri.Objects != 5 || ri.Stale != 5 || ri.WritePrefix != "k8s:enc:aesgcm:v1:key1:" {
		t.Errorf("relabelled: %d objects, %d stale, scanned writing %s; want the 5 scanned, all stale, scanned under key1", ri.Objects, ri.Stale, ri.WritePrefix)
	}
	// The periodic scan is due an hour after the first one, not after the relabel.
	clk.Step(time.Hour - time.Second)
	ctrl.check(ctx)
	if got := ctrl.Inventory().Latest(); !got.RelabelledAt.IsZero() || got.Find("secrets").Objects != 6 {
		t.Errorf("an hour after the first scan: %+v; want a fresh scan of the 6 objects", got.Find("secrets"))
	}
}
