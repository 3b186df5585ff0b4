package migrate

import (
	"context"
	"fmt"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestControllerBacksOffWhileAMigrationKeepsFailing: one object no key can read makes
// every migration fail. The controller used to retry every 5 s check forever (a full
// pass and a decrypt-checked re-scan each time); it must back off per write target
// (5 s doubling to 5 min), start over at once when the write target changes, and reset
// after a pass succeeds.
func TestControllerBacksOffWhileAMigrationKeepsFailing(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, s0 := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, s0, secrets, 20)
	lost := keyOf(secrets, "x", "lost")
	mustPut(t, cli, lost, "k8s:enc:aesgcm:v1:gone:0123456789abcdefghijklmnopqrstuvwxyz")
	sw := &swappable{}
	sw.cur.Store(s0)
	src := FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	c := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], AutoMigrate: true, Clock: fc, Logger: testLogger(t)})
	c.check(ctx) // first inventory: nothing stale
	_, s1 := setFor(t, "secrets", "aesgcm:key2,key1")
	sw.cur.Store(s1)

	// Ten minutes of 5 s checks: attempts at 0, 5, 15, 35, 75, 155 and 315 s.
	attempts := 0
	for i := 0; i <= 120; i++ {
		if c.check(ctx) {
			attempts++
		}
		fc.Step(defaultCheckInterval)
	}
	st := c.Status()
	t.Logf("121 checks over 10 minutes → %d migration attempts; retry at +%s", attempts, st.RetryAt.Sub(fc.Now()))
	if attempts != 7 || st.ConsecutiveFailures != 7 {
		t.Fatalf("%d attempts (%d failures in a row) in 10 minutes, want 7 with 5 s → 5 min backoff", attempts, st.ConsecutiveFailures)
	}
	if !strings.Contains(st.LastError, "cannot be decrypted") || st.RetryAt.Sub(fc.Now()) > defaultMaxRetryBackoff {
		t.Fatalf("status = %q, retry at %s", st.LastError, st.RetryAt)
	}

	// A new write target is tried at once, with the backoff started over.
	_, s2 := setFor(t, "secrets", "aesgcm:key3,key2,key1")
	sw.cur.Store(s2)
	if !c.check(ctx) || c.Status().ConsecutiveFailures != 1 {
		t.Fatalf("after the write key changed: failures in a row = %d, want a fresh attempt", c.Status().ConsecutiveFailures)
	}
	if c.check(ctx) {
		t.Fatal("retried at once after a failure")
	}
	// The lost object is deleted: the next retry succeeds and clears the backoff.
	if _, err := cli.Delete(ctx, lost); err != nil {
		t.Fatal(err)
	}
	fc.Step(defaultRetryBackoff)
	if !c.check(ctx) {
		t.Fatal("no retry after the backoff")
	}
	if st := c.Status(); st.LastError != "" || st.ConsecutiveFailures != 0 || !st.RetryAt.IsZero() {
		t.Fatalf("after a successful pass: %+v", st)
	}
	if c.check(ctx) {
		t.Fatal("migrated again after success")
	}
}

// faultAfter counts reads through the transformers and runs trigger once, at read n.
type faultAfter struct {
	rt      value.ResourceTransformers
	reads   atomic.Int64
	n       int64
	trigger func()
}

func (f *faultAfter) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return faultTransformer{f.rt.TransformerForResource(gr), f}
}

type faultTransformer struct {
	value.Transformer
	f *faultAfter
}

func (t faultTransformer) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	if t.f.reads.Add(1) == t.f.n {
		t.f.trigger()
	}
	return t.Transformer.TransformFromStorage(ctx, data, dataCtx)
}

// TestControllerPluginOutageIsTransient: a migration away from KMS v2 (aesgcm writes,
// the KMS provider still reads) meets a plugin outage after 30 reads: Decrypt answers
// Unavailable. The migration must stop without counting anything unreadable, say the
// plugin is unavailable and will be retried, never advise deleting objects, and finish
// once the plugin is back and the backoff has passed.
func TestControllerPluginOutageIsTransient(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	kms := startKMS(t, "key-a")
	kmsRule := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	// Objects under 60 DEK seeds (one per writer provider), interleaved: the reader
	// calls Decrypt for each seed the first time it meets it. The outage starts at read
	// 30, when at most 29 seeds can have been fetched, so the migration is cut short
	// after it has rewritten some objects.
	const seeds = 60
	var writers []*transformers.Set
	for i := 0; i < seeds; i++ {
		writers = append(writers, buildReady(t, kmsRule+kms.ProviderYAML("plug"), kms.Factory))
	}
	const n = 300
	var keys []string
	var ops []clientv3.Op
	for i := 0; i < n; i++ {
		key := keyOf(secrets, "ns", fmt.Sprintf("obj-%04d", i))
		out, err := writers[i%seeds].TransformerFor(secrets).TransformToStorage(ctx, plaintextFor(key, 0), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		keys = append(keys, key)
		ops = append(ops, clientv3.OpPut(key, string(out)))
		if len(ops) == 100 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
	}
	s0 := buildReady(t, kmsRule+kms.ProviderYAML("plug"), kms.Factory)
	s1 := buildReady(t, kmsRule+providerYAML("aesgcm:key1")+kms.ProviderYAML("plug"), kms.Factory)

	sw := &swappable{}
	sw.cur.Store(s0)
	fault := &faultAfter{rt: sw, n: 30, trigger: func() { kms.Server.SetFaults(kmsplugin.Faults{FailDecrypt: true}) }}
	src := FromRules(fault, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	fc := clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))
	c := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], AutoMigrate: true, Clock: fc, Logger: testLogger(t)})
	c.check(ctx)
	sw.cur.Store(s1)

	if !c.check(ctx) {
		t.Fatal("no migration after the write key changed")
	}
	st := c.Status()
	if st.LastMigration == nil || st.LastError == "" {
		t.Fatalf("the migration did not notice the outage: %+v", st.LastMigration)
	}
	t.Logf("status during the outage: %s", st.LastError)
	if !strings.Contains(st.LastError, "KMS plugin unavailable, will retry") || strings.Contains(st.LastError, "delete") {
		t.Fatalf("status during a plugin outage = %q; want 'plugin unavailable, will retry' and no advice to delete", st.LastError)
	}
	if u := st.LastMigration.Counters.Unreadable; u != 0 {
		t.Fatalf("%d objects counted unreadable during a plugin outage", u)
	}
	if st.RetryAt.Sub(fc.Now()) != defaultRetryBackoff {
		t.Fatalf("retry at %s, want after %s", st.RetryAt, defaultRetryBackoff)
	}
	if c.check(ctx) {
		t.Fatal("retried before the backoff passed")
	}

	kms.Server.SetFaults(kmsplugin.Faults{})
	fc.Step(defaultRetryBackoff)
	if !c.check(ctx) {
		t.Fatal("no retry after the backoff")
	}
	if st := c.Status(); st.LastError != "" || st.LastMigration.Error != "" {
		t.Fatalf("after the plugin recovered: %q", st.LastError)
	}
	for _, k := range keys {
		plain, stale, _ := readPlain(t, cli, s1, secrets, k)
		if stale || string(plain) != string(plaintextFor(k, 0)) {
			t.Fatalf("%s: stale=%v, plaintext intact=%v", k, stale, string(plain) == string(plaintextFor(k, 0)))
		}
	}
}
