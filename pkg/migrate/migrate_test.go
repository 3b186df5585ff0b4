package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

func TestMigrateRewritesEveryStaleObjectAndIsIdempotent(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets, configmaps", "aesgcm:key1")
	skeys := writeObjects(t, cli, old, secrets, 700)
	ckeys := writeObjects(t, cli, old, configmaps, 300)
	before := map[string]int64{}
	for _, k := range skeys[:50] {
		_, _, rev := readPlain(t, cli, old, secrets, k)
		before[k] = rev
	}

	cfg, next := setFor(t, "secrets, configmaps", "aesgcm:key2,key1")
	store := &InventoryStore{}
	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 64, BatchSize: 16, Inventory: store, ConfigHash: cfg.Hash})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != 1000 || res.Current != 0 || res.Unreadable != 0 || res.Passes != 1 {
		t.Fatalf("result = %+v, want 1000 rewritten in one pass", res)
	}
	for i, k := range append(skeys, ckeys...) {
		gr := secrets
		if i >= len(skeys) {
			gr = configmaps
		}
		plain, stale, rev := readPlain(t, cli, next, gr, k)
		if stale || !bytes.Equal(plain, plaintextFor(k, 0)) {
			t.Fatalf("%s: stale=%v plaintext changed=%v", k, stale, !bytes.Equal(plain, plaintextFor(k, 0)))
		}
		if r, ok := before[k]; ok && rev <= r {
			t.Fatalf("%s: ModRevision %d not advanced from %d", k, rev, r)
		}
	}
	inv := store.Latest()
	if inv == nil || inv.TotalStale() != 0 || !inv.DecryptChecked || bucketCount(inv.Find("secrets"), "k8s:enc:aesgcm:v1:key2:", false) != 700 {
		t.Fatalf("verifying inventory = %+v", inv)
	}

	// A second run finds nothing to do and writes nothing.
	revBefore := currentRev(t, cli)
	res, err = Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources()})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != 0 || res.Current != 1000 {
		t.Fatalf("second run = %+v, want 0 rewritten, 1000 current", res)
	}
	if rev := currentRev(t, cli); rev != revBefore {
		t.Fatalf("second run wrote to etcd: revision %d → %d", revBefore, rev)
	}
}

func TestMigratePlaintextToEncryptedAndKeepsLeases(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, plain := setFor(t, "secrets", "identity")
	keys := writeObjects(t, cli, plain, secrets, 40)
	lease, err := cli.Grant(ctx, 3600)
	if err != nil {
		t.Fatal(err)
	}
	leased := keyOf(secrets, "ev", "with-ttl")
	if _, err := cli.Put(ctx, leased, string(plaintextFor(leased, 0)), clientv3.WithLease(lease.ID)); err != nil {
		t.Fatal(err)
	}
	_, enc := setFor(t, "secrets", "secretbox:k1", "identity")
	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(enc), Resources: testResources()[:1]})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != 41 {
		t.Fatalf("rewritten = %d, want 41", res.Rewritten)
	}
	for _, k := range append(keys, leased) {
		resp, err := cli.Get(ctx, k)
		if err != nil {
			t.Fatal(err)
		}
		if !hasPrefix(resp.Kvs[0].Value, "k8s:enc:secretbox:v1:k1:") || bytes.Contains(resp.Kvs[0].Value, []byte("Secret{")) {
			t.Fatalf("%s not encrypted with secretbox k1", k)
		}
	}
	resp, _ := cli.Get(ctx, leased)
	if clientv3.LeaseID(resp.Kvs[0].Lease) != lease.ID {
		t.Fatalf("lease of %s = %x after rewrite, want %x", leased, resp.Kvs[0].Lease, lease.ID)
	}
}

// TestCommitConflicts drives the compare-and-swap against real etcd: the object changes
// between the read and the write, as when an apiserver updates it concurrently.
// commitBed is the stage of the compare-and-swap tests: real etcd, objects written
// under key1 and a configuration that writes key2.
type commitBed struct {
	t         *testing.T
	cli       *clientv3.Client
	old, next *transformers.Set
	tr        value.Transformer
}

func newCommitBed(t *testing.T) *commitBed {
	_, old := setFor(t, "secrets", "aesgcm:key1")
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	return &commitBed{t: t, cli: startEtcd(t), old: old, next: next, tr: next.TransformerFor(secrets)}
}

// migrator is a migrator of batches of batchSize to key2, with its writer.
func (b *commitBed) migrator(batchSize int) *migrator {
	m := &migrator{opts: Options{Client: b.cli, Source: FromSet(b.next), BatchSize: batchSize, Clock: clock.RealClock{}}, log: testLogger(b.t)}
	m.writer = m.newWriter(nil)
	return m
}

// stage writes secret ns/name under key1 and returns its rewrite to key2, as a
// migration's read prepared it, and its key.
func (b *commitBed) stage(ns, name string) (rewrite, string) {
	b.t.Helper()
	key := keyOf(secrets, ns, name)
	writeAt(b.t, b.cli, b.old, key, plaintextFor(key, 0))
	resp, err := b.cli.Get(context.Background(), key)
	if err != nil {
		b.t.Fatal(err)
	}
	rw, result, err := b.migrator(8).prepare(context.Background(), b.tr, resp.Kvs[0])
	if err != nil || result != "" {
		b.t.Fatalf("prepare %s: result %q err %v", key, result, err)
	}
	return rw, key
}

func TestCommitConflicts(t *testing.T) {
	ctx := context.Background()
	b := newCommitBed(t)
	cli, old, next, tr := b.cli, b.old, b.next, b.tr
	newMigrator := func() *migrator { return b.migrator(8) }
	stage := func(name string) (rewrite, string) { return b.stage("c", name) }

	t.Run("concurrent update with the old key is rewritten from the new value", func(t *testing.T) {
		rw, key := stage("old-writer")
		writeAt(t, cli, old, key, plaintextFor(key, 1)) // the concurrent update
		m := newMigrator()
		if err := m.commit(ctx, tr, "secrets", []rewrite{rw}); err != nil {
			t.Fatal(err)
		}
		plain, stale, _ := readPlain(t, cli, next, secrets, key)
		if stale || !bytes.Equal(plain, plaintextFor(key, 1)) {
			t.Fatalf("after conflict: stale=%v plaintext=%q, want the concurrent update's content on key2", stale, plain)
		}
		if c := m.c.snapshot(); c.Conflicts != 1 || c.Rewritten != 1 {
			t.Fatalf("counters = %+v, want 1 conflict, 1 rewritten", c)
		}
	})
	t.Run("concurrent update with the new key is left alone", func(t *testing.T) {
		rw, key := stage("new-writer")
		writeAt(t, cli, next, key, plaintextFor(key, 2))
		resp, _ := cli.Get(ctx, key)
		want := resp.Kvs[0]
		m := newMigrator()
		if err := m.commit(ctx, tr, "secrets", []rewrite{rw}); err != nil {
			t.Fatal(err)
		}
		resp, _ = cli.Get(ctx, key)
		if got := resp.Kvs[0]; got.ModRevision != want.ModRevision || !bytes.Equal(got.Value, want.Value) {
			t.Fatalf("the migration overwrote a concurrent update")
		}
		if c := m.c.snapshot(); c.Conflicts != 1 || c.Current != 1 || c.Rewritten != 0 {
			t.Fatalf("counters = %+v, want 1 conflict, 1 current", c)
		}
	})
	t.Run("concurrent delete is not resurrected", func(t *testing.T) {
		rw, key := stage("deleted")
		if _, err := cli.Delete(ctx, key); err != nil {
			t.Fatal(err)
		}
		m := newMigrator()
		if err := m.commit(ctx, tr, "secrets", []rewrite{rw}); err != nil {
			t.Fatal(err)
		}
		resp, _ := cli.Get(ctx, key)
		if len(resp.Kvs) != 0 {
			t.Fatal("a deleted object was written back")
		}
		if c := m.c.snapshot(); c.Gone != 1 {
			t.Fatalf("counters = %+v, want 1 gone", c)
		}
	})
	t.Run("one conflict in a batch does not lose the others", func(t *testing.T) {
		var batch []rewrite
		var keys []string
		for _, n := range []string{"b0", "b1", "b2", "b3"} {
			rw, key := stage(n)
			batch = append(batch, rw)
			keys = append(keys, key)
		}
		writeAt(t, cli, old, keys[2], plaintextFor(keys[2], 7))
		before, err := cli.Get(ctx, keys[0])
		if err != nil {
			t.Fatal(err)
		}
		m := newMigrator()
		if err := m.commit(ctx, tr, "secrets", batch); err != nil {
			t.Fatal(err)
		}
		// The failed transaction read the batch back; the retry wrote all four in one
		// transaction (one etcd revision), not one transaction per object.
		after, err := cli.Get(ctx, keys[0])
		if err != nil {
			t.Fatal(err)
		}
		if d := after.Header.Revision - before.Header.Revision; d != 1 {
			t.Fatalf("the batch's rewrite took %d etcd revisions, want 1 (one transaction)", d)
		}
		for i, k := range keys {
			gen := 0
			if i == 2 {
				gen = 7
			}
			plain, stale, _ := readPlain(t, cli, next, secrets, k)
			if stale || !bytes.Equal(plain, plaintextFor(k, gen)) {
				t.Fatalf("%s: stale=%v plaintext=%q", k, stale, plain)
			}
		}
		if c := m.c.snapshot(); c.Rewritten != 4 || c.Conflicts != 1 {
			t.Fatalf("counters = %+v, want 4 rewritten, 1 conflict", c)
		}
	})
}

// walkingWriter updates, before every transaction the migration commits, the next of
// keys (with the new key, as an apiserver would): a client going through the objects
// in key order while the migration retries a batch of them.
type walkingWriter struct {
	clientv3.KV
	t    *testing.T
	set  *transformers.Set
	keys []string
	next int
}

func (w *walkingWriter) Txn(ctx context.Context) clientv3.Txn {
	return &walkingTxn{Txn: w.KV.Txn(ctx), w: w}
}

type walkingTxn struct {
	clientv3.Txn
	w *walkingWriter
}

func (x *walkingTxn) If(cs ...clientv3.Cmp) clientv3.Txn   { x.Txn = x.Txn.If(cs...); return x }
func (x *walkingTxn) Then(ops ...clientv3.Op) clientv3.Txn { x.Txn = x.Txn.Then(ops...); return x }
func (x *walkingTxn) Else(ops ...clientv3.Op) clientv3.Txn { x.Txn = x.Txn.Else(ops...); return x }
func (x *walkingTxn) Commit() (*clientv3.TxnResponse, error) {
	if w := x.w; w.next < len(w.keys) {
		key := w.keys[w.next]
		w.next++
		out, err := w.set.TransformerFor(secrets).TransformToStorage(context.Background(), plaintextFor(key, 9), value.DefaultContext(key))
		if err != nil {
			w.t.Fatal(err)
		}
		if _, err := w.KV.Put(context.Background(), key, string(out)); err != nil {
			w.t.Fatal(err)
		}
	}
	return x.Txn.Commit()
}

// A client that changes another object of the batch before every attempt (walking
// through them in key order) does not leave the batch stale: after two conflicts in a
// row the batch is committed in halves. Retried whole, each attempt lost to the next
// object the client changed, and after ten attempts the rest of the batch was left to
// a second pass.
func TestCommitOutlastsAClientWalkingThroughTheBatch(t *testing.T) {
	ctx := context.Background()
	b := newCommitBed(t)
	cli, next := b.cli, b.next
	var batch []rewrite
	var keys []string
	for i := range 40 {
		rw, key := b.stage("walk", fmt.Sprintf("s-%02d", i))
		batch, keys = append(batch, rw), append(keys, key)
	}
	walker := &walkingWriter{KV: cli.KV, t: t, set: next, keys: keys}
	cli.KV = walker
	defer func() { cli.KV = walker.KV }()
	m := b.migrator(64)
	if err := m.commit(ctx, b.tr, "secrets", batch); err != nil {
		t.Fatal(err)
	}
	cli.KV = walker.KV
	stale := 0
	for _, k := range keys {
		if _, isStale, _ := readPlain(t, cli, next, secrets, k); isStale {
			stale++
		}
	}
	if stale > 0 {
		t.Fatalf("%d of %d objects left stale after the client changed %d of them, one before each attempt", stale, len(keys), walker.next)
	}
	if c := m.c.snapshot(); c.Rewritten+c.Current != int64(len(keys)) {
		t.Fatalf("counters %+v: %d rewritten and current, want %d", c, c.Rewritten+c.Current, len(keys))
	}
}

func TestMigrateResumesFromCheckpoint(t *testing.T) {
	cli := startEtcd(t)
	_, old := setFor(t, "secrets, configmaps", "aescbc:key1")
	writeObjects(t, cli, old, secrets, 1000)
	writeObjects(t, cli, old, configmaps, 200)
	_, next := setFor(t, "secrets, configmaps", "aesgcm:new", "aescbc:key1")
	ckpt := filepath.Join(t.TempDir(), "migration.json")

	// Stop the first run ("kill") once it has handled about half of the secrets.
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 100, CheckpointPath: ckpt,
		Progress: func(p Progress) {
			if p.Resource == "secrets" && p.Done >= 500 {
				cancel()
			}
		}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("first run: err = %v, want context.Canceled", err)
	}
	c, err := fileCheckpoints(ckpt).Load(context.Background())
	if err != nil || c == nil || c.Resource != "secrets" || c.LastKey == "" || c.Completed {
		t.Fatalf("checkpoint after the stop = %+v, %v", c, err)
	}
	stoppedAt := c.LastKey
	// Everything up to the checkpoint is on the new key already.
	inv, _ := TakeInventory(context.Background(), InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources()[:1]})
	migratedBefore := bucketCount(inv.Find("secrets"), "k8s:enc:aesgcm:v1:new:", false)
	if migratedBefore < 500 || migratedBefore >= 1000 {
		t.Fatalf("%d secrets migrated when stopped, want about half", migratedBefore)
	}

	// Without --resume an unfinished checkpoint is refused.
	_, err = Migrate(context.Background(), Options{Client: cli, Source: FromSet(next), Resources: testResources(), CheckpointPath: ckpt})
	if err == nil || !strings.Contains(err.Error(), "--resume") {
		t.Fatalf("run without resume: err = %v, want a hint to pass --resume", err)
	}

	var firstSecret string
	res, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 100, CheckpointPath: ckpt, Resume: true,
		Progress: func(p Progress) {
			if p.Resource == "secrets" && p.Done > 0 && firstSecret == "" {
				firstSecret = "seen"
			}
		}})
	if err != nil {
		t.Fatal(err)
	}
	// The resumed run continued after the checkpoint: it scanned fewer secrets than
	// exist, and its counters include the first run's.
	if res.Rewritten != 1200 {
		t.Fatalf("rewritten over both runs = %d, want 1200", res.Rewritten)
	}
	if res.Scanned >= 1000+1200 || res.Scanned < 1200 {
		t.Fatalf("scanned over both runs = %d; a resume from %q should not rescan the first half", res.Scanned, stoppedAt)
	}
	c, _ = fileCheckpoints(ckpt).Load(context.Background())
	if c == nil || !c.Completed {
		t.Fatalf("checkpoint after success = %+v, want completed", c)
	}
	if res.Verified.TotalStale() != 0 {
		t.Fatalf("verified stale = %d", res.Verified.TotalStale())
	}
}

func TestMigrateReportsUnreadableObjects(t *testing.T) {
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, old, secrets, 10)
	mustPut(t, cli, keyOf(secrets, "x", "lost"), "k8s:enc:aesgcm:v1:gone:0123456789abcdefghijklmnopqrstuvwxyz")
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	res, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(next), Resources: testResources()[:1]})
	if !errors.Is(err, ErrNotFinished) || !strings.Contains(err.Error(), "/registry/secrets/x/lost") {
		t.Fatalf("err = %v, want ErrNotFinished naming the unreadable key", err)
	}
	if res.Rewritten != 10 || res.Unreadable != 1 {
		t.Fatalf("result = %+v", res)
	}
	// The unreadable value is untouched.
	resp, _ := cli.Get(context.Background(), keyOf(secrets, "x", "lost"))
	if string(resp.Kvs[0].Value) != "k8s:enc:aesgcm:v1:gone:0123456789abcdefghijklmnopqrstuvwxyz" {
		t.Fatal("an unreadable value was modified")
	}
}

func TestMigrateRateLimit(t *testing.T) {
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, old, secrets, 60)
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	res, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(next), Resources: testResources()[:1], Rate: 100})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != 60 {
		t.Fatalf("rewritten = %d", res.Rewritten)
	}
	res2, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(mustSet(t, mustConfig(t, configYAML("secrets", "aesgcm:key3", "aesgcm:key2,key1")))), Resources: testResources()[:1], Rate: 20})
	if err != nil {
		t.Fatal(err)
	}
	// A burst of 20, then 40 objects at 20/s: at least 2 s.
	if res2.Duration.Seconds() < 1.8 {
		t.Fatalf("60 objects at --rate 20 took %s, want ≥ 2 s", res2.Duration)
	}
}

func writeAt(t testing.TB, cli *clientv3.Client, set *transformers.Set, key string, plain []byte) {
	t.Helper()
	out, err := set.TransformerFor(secrets).TransformToStorage(context.Background(), plain, value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	mustPut(t, cli, key, string(out))
}

func currentRev(t testing.TB, cli *clientv3.Client) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), "/rekey-test-revision-probe")
	if err != nil {
		t.Fatal(err)
	}
	return resp.Header.Revision
}

func testLogger(t testing.TB) klog.Logger { return ktesting.NewLogger(t, ktesting.NewConfig()) }

// TestMigrateKMSv1ToTheWriteKey: values a kube-apiserver wrote with KMS v1 (AES-GCM data,
// and AES-CBC data of clusters before 1.25) are counted stale under a configuration
// that keeps the v1 provider behind a new write key, and migration rewrites every one
// of them under the write key.
func TestMigrateKMSv1ToTheWriteKey(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	plugin := enctest.StartKMSv1(t, "kek1")
	prefix := ResourceFor(DefaultEtcdPrefix, secrets).KeyPrefix
	gcmKeys := enctest.WriteObjectsWith(t, cli, enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", false), prefix+"gcm-", 40)
	cbcKeys := enctest.WriteObjectsWith(t, cli, enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", true), prefix+"cbc-", 20)

	cfg := mustConfig(t, configYAML("secrets, configmaps", "aesgcm:key2")+plugin.ProviderYAML("old"))
	next := mustSet(t, cfg)
	inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: FromSet(next), Resources: testResources(), ConfigHash: cfg.Hash})
	if err != nil {
		t.Fatal(err)
	}
	s := inv.Find("secrets")
	if n := bucketCount(s, "k8s:enc:kms:v1:old:", true); n != 60 || inv.TotalStale() != 60 {
		t.Fatalf("inventory: %d stale KMS v1 values (total stale %d), want 60: %+v", n, inv.TotalStale(), s.Buckets)
	}
	for _, b := range s.Buckets {
		if b.Provider == transformers.ProviderKMSv1 && (!b.KnownKey || b.Describe() != `kms v1 provider "old"`) {
			t.Fatalf("KMS v1 bucket %+v (%q)", b, b.Describe())
		}
	}

	store := &InventoryStore{}
	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources(), Inventory: store, ConfigHash: cfg.Hash})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != 60 || res.Unreadable != 0 {
		t.Fatalf("result = %+v, want 60 rewritten", res)
	}
	// Readable without the v1 provider: nothing is left under it.
	_, writer := setFor(t, "secrets, configmaps", "aesgcm:key2")
	for _, k := range append(gcmKeys, cbcKeys...) {
		plain, stale, _ := readPlain(t, cli, writer, secrets, k)
		if stale || !bytes.Equal(plain, plaintextFor(k, 0)) {
			t.Fatalf("%s: stale=%v plaintext changed=%v", k, stale, !bytes.Equal(plain, plaintextFor(k, 0)))
		}
	}
	if inv := store.Latest(); inv == nil || inv.TotalStale() != 0 {
		t.Fatalf("verifying inventory = %+v", inv)
	}
}
