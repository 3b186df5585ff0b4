package cluster

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/goleak"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/leakcheck"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

func TestMain(m *testing.M) {
	leakcheck.Main(m,
		// etcd's client and embedded server leave background loggers and gRPC
		// goroutines that end shortly after Close.
		goleak.IgnoreTopFunction("go.opencensus.io/stats/view.(*worker).start"),
		goleak.IgnoreAnyFunction("google.golang.org/grpc/internal/grpcsync.(*CallbackSerializer).run"),
	)
}

var secrets = schema.GroupResource{Resource: "secrets"}

func testKey(name string) string {
	sum := sha256.Sum256([]byte("cluster test key " + name))
	return base64.StdEncoding.EncodeToString(sum[:])
}

// secretsConfig renders a configuration whose secrets rule has aesgcm keys in order.
func secretsConfig(keys ...string) string {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "      - name: %s\n        secret: %s\n", k, testKey(k))
	}
	return b.String()
}

func writeFile(t *testing.T, path, content string) {
	t.Helper()
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// member is one apiserver of a test: a reload agent on its own file and its node.
type member struct {
	id    string
	path  string
	node  *Node
	agent *reload.Agent
}

func startMember(t *testing.T, cli *clientv3.Client, id, content string, mutate ...func(*Options)) *member {
	t.Helper()
	m := &member{id: id, path: filepath.Join(t.TempDir(), "enc.yaml")}
	writeFile(t, m.path, content)
	// The production lease: a 2 s lease on a real clock saw race-detector runs on two
	// busy cores starve a node's clock goroutine past it (a "pause"), which holds writes
	// and fails readiness. Tests of the lease's own timing take shortLease.
	opts := Options{Client: cli, ID: id, ResourcePrefix: "/registry", LeaseTTL: DefaultLeaseTTL, Logger: ktesting.NewLogger(t, ktesting.NewConfig())}
	for _, f := range mutate {
		f(&opts)
	}
	node, err := New(opts)
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Start(context.Background()); err != nil {
		t.Fatal(err)
	}
	agent, err := reload.NewAgent(context.Background(), reload.Options{
		Path: m.path, AutomaticReload: true, GracePeriod: time.Millisecond,
		WriteFence: node.WriteFence, OnChange: node.Notify, Guard: node.Guard, WriteGate: node.WriteGate,
		Logger: opts.Logger,
	})
	if err != nil {
		node.Close()
		t.Fatal(err)
	}
	node.Attach(agent)
	m.node, m.agent = node, agent
	t.Cleanup(m.stop)
	if fc, ok := opts.Clock.(*testingclock.FakeClock); ok {
		// A test that steps the clock before a goroutine has made its ticker steps past
		// it: that ticker then never fires (on a loaded machine watchPauses missed the
		// step of a pause, and the write gate stayed shut). Wait for the node's three:
		// its loop, watchPauses and the view's progress requests.
		eventually(t, "the node's tickers on the fake clock", func() bool { return fc.Waiters() >= nodeTickers })
	}
	return m
}

// nodeTickers is how many tickers a started node keeps on its clock.
const nodeTickers = 3

// shortLease is a startMember option for tests of what a lease's expiry does: a 2 s lease.
func shortLease(o *Options) { o.LeaseTTL = 2 * time.Second }

func (m *member) stop() {
	if m.node != nil {
		m.node.Close()
		m.agent.Close()
		m.node = nil
	}
}

// decideWithCurrentView waits until m's fence has been fed a view at least as new as
// etcd's revision now, then has m's agent apply the fence again: what m writes
// afterwards is its decision with everything etcd held when it was called.
func (m *member) decideWithCurrentView(t *testing.T) {
	t.Helper()
	resp, err := m.node.opts.Client.Get(context.Background(), "/", clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	eventually(t, m.id+"'s fence to see etcd's current revision", func() bool {
		m.node.mu.Lock()
		defer m.node.mu.Unlock()
		return m.node.fence.viewRev >= resp.Header.Revision
	})
	if err := m.agent.Refence(); err != nil {
		t.Fatal(err)
	}
}

func (m *member) writePrefix(t *testing.T) string {
	t.Helper()
	out, err := m.agent.TransformerForResource(secrets).TransformToStorage(context.Background(), []byte("x"), value.DefaultContext("/registry/secrets/ns/x"))
	if err != nil {
		// A write refused for a moment (a promotion handshake) is no prefix: the
		// caller's comparison fails, or its eventually tries again.
		return "refused: " + err.Error()
	}
	// k8s:enc:aesgcm:v1:<key>:<ciphertext>
	parts := bytes.SplitN(out, []byte(":"), 6)
	return string(bytes.Join(parts[:5], []byte(":"))) + ":"
}

// startPair starts etcd and two members, a and b, on secretsConfig("k1"), and returns
// once a sees b.
func startPair(t *testing.T) (*clientv3.Client, *member, *member) {
	t.Helper()
	cli := etcdtest.Start(t).Client(t)
	a := startMember(t, cli, "a", secretsConfig("k1"))
	b := startMember(t, cli, "b", secretsConfig("k1"))
	eventually(t, "a sees b", func() bool { return memberIDs(a.node.view) == "a,b" })
	return cli, a, b
}

func eventually(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func memberIDs(v *view) string {
	var ids []string
	for _, m := range v.Members() {
		ids = append(ids, m.APIServerID)
	}
	return strings.Join(ids, ",")
}

// TestMembershipLeaseAndClose: members publish under leases; a clean shutdown deletes
// the key at once, a dead member's key expires with its lease.
func TestMembershipLeaseAndClose(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	a := startMember(t, cli, "a", secretsConfig("k1"))
	b := startMember(t, cli, "b", secretsConfig("k1"))
	eventually(t, "both members visible to a", func() bool { return memberIDs(a.node.view) == "a,b" })

	resp, err := cli.Get(context.Background(), memberKey(defaultPrefix, "b"))
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("member key of b: %v %v", resp, err)
	}
	st, err := ParseMemberState(resp.Kvs[0].Value)
	if err != nil {
		t.Fatal(err)
	}
	if st.ConfigHash == "" || len(st.Resources) != 1 || st.Resources[0].Write.Key != "k1" || resp.Kvs[0].Lease == 0 {
		t.Fatalf("b published %+v (lease %d)", st, resp.Kvs[0].Lease)
	}
	if bytes.Contains(resp.Kvs[0].Value, []byte(testKey("k1"))) {
		t.Fatal("the member state contains key material")
	}

	b.stop()
	eventually(t, "b gone after a clean shutdown", func() bool { return memberIDs(a.node.view) == "a" })

	// A member that dies without revoking: stop its keep-alive only.
	c := startMember(t, cli, "c", secretsConfig("k1"), shortLease)
	eventually(t, "c visible", func() bool { return memberIDs(a.node.view) == "a,c" })
	c.node.cancel()
	<-c.node.done
	c.node.pub.mu.Lock()
	lease := c.node.pub.session.Lease()
	c.node.pub.dropLocked() // the keep-alive stops; the lease is not revoked
	c.node.pub.mu.Unlock()
	// The lease outlives the keep-alive: asked of etcd itself, not timed (the last
	// renewal can be over a second old at the drop, so a timed lower bound on the
	// disappearance failed on its own; a starved watch would pass any bound).
	ttl, err := cli.TimeToLive(t.Context(), lease)
	if err != nil {
		t.Fatal(err)
	}
	if ttl.TTL <= 0 {
		t.Fatalf("c's lease %x after the keep-alive stopped: TTL %d (revoked or expired at once)", lease, ttl.TTL)
	}
	eventually(t, "c gone after its lease expired", func() bool { return memberIDs(a.node.view) == "a" })
}

// TestFencePromotesWhenTheOtherMemberCatchesUp is the story on one etcd: a's
// file gets the new key k2 first; a keeps writing k1 until b's file can read k2, then
// promotes k2 by itself. b's own file, once it has k2 first, promotes at once.
func TestFencePromotesWhenTheOtherMemberCatchesUp(t *testing.T) {
	_, a, b := startPair(t)
	// The fence learns the members from the watch's callback, a moment after the view.
	eventually(t, "a's fence sees b", func() bool {
		a.node.mu.Lock()
		defer a.node.mu.Unlock()
		_, ok := a.node.fence.members["b"]
		return ok
	})

	writeFile(t, a.path, secretsConfig("k2", "k1"))
	if err := a.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := a.writePrefix(t); p != "k8s:enc:aesgcm:v1:k1:" {
		t.Fatalf("a writes with %q while b cannot read k2; want k1", p)
	}
	if h := a.node.Holds(); len(h) != 1 || h[0].Held.Key != "k2" || strings.Join(h[0].WaitingFor, ",") != "b" {
		t.Fatalf("a's holds = %+v, want k2 waiting for b", h)
	}
	// a publishes its hold: the verdict names it.
	eventually(t, "the verdict to show a holding k2 for b", func() bool {
		v := a.node.Status().Verdict
		return !v.Converged && strings.Contains(v.Summary, "promoting aesgcm/k2 for secrets on a, waiting for b")
	})
	// Holding stays held while nothing changes: a decides again with a view as new as
	// etcd is now (its own record holding k2 included).
	a.decideWithCurrentView(t)
	if p := a.writePrefix(t); p != "k8s:enc:aesgcm:v1:k1:" {
		t.Fatalf("a promoted k2 with b unable to read it (writes %q)", p)
	}
	if v := a.node.Status().Verdict; v.Converged || !strings.Contains(v.Summary, "promoting aesgcm/k2 for secrets on a, waiting for b") {
		t.Fatalf("verdict while held = %+v", v)
	}

	// b's file catches up: b reads k2 (and holds it itself until a reads it: a does).
	writeFile(t, b.path, secretsConfig("k2", "k1"))
	if err := b.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	// a can read k2, so b holds it only for the handshake: one publish of k2 as held
	// and one read of the members after it.
	eventually(t, "b promotes k2 after the handshake", func() bool { return b.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })
	eventually(t, "a promotes k2 on its own", func() bool { return a.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })
	eventually(t, "the cluster converges", func() bool { return a.node.Status().Verdict.Converged })
}

// TestStragglerIsNotReadyAndGuardRefusesDrop: a member that joins with a file that
// cannot read the key another member already writes is not ready, naming the key, and
// does not pull the others back; once its file catches up it is ready. Dropping a key
// another member writes with is refused.
func TestStragglerIsNotReadyAndGuardRefusesDrop(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	a := startMember(t, cli, "a", secretsConfig("k2", "k1"))
	// Alone, a writes k2 once its record shows k2 and a read after it finds nobody
	// who cannot read it.
	eventually(t, "a alone writes k2", func() bool { return a.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })
	reg := metrics.NewKubeRegistry()
	bm, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	b := startMember(t, cli, "b", secretsConfig("k1"), func(o *Options) { o.Metrics = bm })
	eventually(t, "a sees b", func() bool { return memberIDs(a.node.view) == "a,b" })
	eventually(t, "b sees a", func() bool { return memberIDs(b.node.view) == "a,b" })
	eventually(t, "b not ready, naming k2", func() bool {
		err := b.node.ReadyzCheck().Check(nil)
		return err != nil && strings.Contains(err.Error(), "secrets: aesgcm/k2 (written by a)")
	})
	// a decides again with a view as new as etcd is now (b's record included).
	a.decideWithCurrentView(t)
	if p := a.writePrefix(t); p != "k8s:enc:aesgcm:v1:k2:" {
		t.Fatalf("the straggler pulled a back: a writes %q", p)
	}
	if err := a.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("a is not ready: %v", err)
	}

	writeFile(t, b.path, secretsConfig("k2", "k1"))
	if err := b.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if err := b.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("b is not ready after its file caught up: %v", err)
	}
	eventually(t, "b writes k2", func() bool { return b.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })

	// b drops k2 (which a writes with): refused; the old configuration keeps serving.
	writeFile(t, b.path, secretsConfig("k1"))
	err = b.agent.Reload(context.Background())
	if err == nil || !strings.Contains(err.Error(), "aesgcm/k2 is the write key of apiserver a") {
		t.Fatalf("dropping k2 = %v, want a refusal naming a", err)
	}
	if r := (*guard.RefusedError)(nil); !errors.As(err, &r) || r.Check != guard.Cluster {
		t.Errorf("dropping k2 = %#v, want a refusal of the cluster check (pkg/guard counts it)", err)
	}
	if p := b.writePrefix(t); p != "k8s:enc:aesgcm:v1:k2:" {
		t.Fatalf("b writes %q after a refused reload", p)
	}
}

// TestReadinessCountsStoredKeysAnotherMemberReads: a stored key this apiserver cannot
// read fails readiness only when another live member can read it; data nobody reads
// is lost, not a sign of a straggler.
func TestReadinessCountsStoredKeysAnotherMemberReads(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	store := &migrate.InventoryStore{}
	store.Set(&migrate.Inventory{TakenAt: time.Now(), Resources: []migrate.ResourceInventory{{
		Resource: "secrets", Objects: 7,
		Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k9"}, Objects: 7}},
	}}})
	a := startMember(t, cli, "a", secretsConfig("k1"), func(o *Options) { o.Inventory = store })
	if err := a.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("a alone, with data under a key nobody reads: %v; want ready", err)
	}
	startMember(t, cli, "b", secretsConfig("k1", "k9"))
	eventually(t, "a not ready, naming k9", func() bool {
		err := a.node.ReadyzCheck().Check(nil)
		return err != nil && strings.Contains(err.Error(), "secrets: aesgcm/k9 (7 stored objects, readable by b)")
	})
}

// TestDisagreementAlarm: a hold that lasts longer than the alarm threshold raises the
// alarm (status condition, verdict) on the injected clock.
func TestDisagreementAlarm(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	clk := testingclock.NewFakeClock(time.Now())
	// Long leases: a 2 s lease that lapses on a loaded machine makes b vanish for a
	// moment, which ends the disagreement, and the fake clock never reaches the alarm
	// from the restarted disagreement (seen once on a loaded machine).
	long := func(o *Options) { o.LeaseTTL = time.Minute }
	a := startMember(t, cli, "a", secretsConfig("k1"), long, func(o *Options) { o.Clock = clk })
	startMember(t, cli, "b", secretsConfig("k1"), long)
	eventually(t, "a sees b", func() bool { return memberIDs(a.node.view) == "a,b" })
	writeFile(t, a.path, secretsConfig("k2", "k1"))
	if err := a.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	a.node.evaluate()
	if st := a.node.Status(); len(st.Conditions) != 0 || st.DisagreeingSince.IsZero() {
		t.Fatalf("right after the hold: conditions %v, disagreeing since %v", st.Conditions, st.DisagreeingSince)
	}
	clk.Step(DefaultDisagreementAlarm + time.Second)
	a.node.evaluate()
	a.node.Notify() // publish the disagreement time
	eventually(t, "the alarm in a's status", func() bool {
		st := a.node.Status()
		return slices.Contains(st.Conditions, "DisagreementAlarm") && strings.HasPrefix(st.Verdict.Summary, "alarm: promoting aesgcm/k2")
	})
}

// TestReadinessFailsClosedUntilAnInventoryIsKnown: a straggler restarted with an old
// file (here: b, whose file cannot read k2) is not ready before its first inventory,
// even though no live member writes k2 any more and nothing else it knows names k2;
// with the inventory counting objects under k2 (readable by a) it stays not ready and
// names k2. Before the fix it answered ready until the inventory arrived.
func TestReadinessFailsClosedUntilAnInventoryIsKnown(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	startMember(t, cli, "a", secretsConfig("k1", "k2"))
	store := &migrate.InventoryStore{}
	b := startMember(t, cli, "b", secretsConfig("k1"), func(o *Options) { o.Inventory = store })
	// a starts by holding k1 for the promotion handshake and writing k2 meanwhile; b,
	// which cannot read k2, would rightly count that against its readiness.
	eventually(t, "b sees a writing k1", func() bool {
		for _, m := range b.node.view.Members() {
			if m.APIServerID == "a" && len(m.Resources) > 0 && m.Resources[0].Write.Key == "k1" {
				return memberIDs(b.node.view) == "a,b"
			}
		}
		return false
	})
	err := b.node.ReadyzCheck().Check(nil)
	if err == nil || !strings.Contains(err.Error(), "no inventory of the stored objects yet") {
		t.Fatalf("b before any inventory: %v; want not ready (no inventory yet)", err)
	}
	store.Set(&migrate.Inventory{TakenAt: time.Now(), Resources: []migrate.ResourceInventory{{
		Resource: "secrets", Objects: 317,
		Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k2"}, Objects: 317}},
	}}})
	err = b.node.ReadyzCheck().Check(nil)
	if err == nil || !strings.Contains(err.Error(), "secrets: aesgcm/k2 (317 stored objects, readable by a)") {
		t.Fatalf("b with the inventory: %v; want not ready naming k2", err)
	}
	store.Set(&migrate.Inventory{TakenAt: time.Now(), Resources: []migrate.ResourceInventory{{
		Resource: "secrets", Objects: 317,
		Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k1"}, Objects: 317}},
	}}})
	if err := b.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("b with every stored object readable: %v; want ready", err)
	}
}

// storeSecrets writes n stored Secrets through m's transformers straight into etcd,
// named by nameFormat (a Sprintf format with one integer verb).
func storeSecrets(t *testing.T, cli *clientv3.Client, m *member, n int, nameFormat string) {
	t.Helper()
	ctx := context.Background()
	tr := m.agent.TransformerForResource(secrets)
	for i := range n {
		key := fmt.Sprintf(nameFormat, i)
		out, err := tr.TransformToStorage(ctx, storedObject(key), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(out)); err != nil {
			t.Fatal(err)
		}
	}
}

// eventLog is an events.Sink that keeps the messages.
type eventLog struct {
	mu   sync.Mutex
	msgs []string
}

func (l *eventLog) Event(_ events.Kind, _, message string) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.msgs = append(l.msgs, message)
}

func (l *eventLog) has(s string) bool {
	l.mu.Lock()
	defer l.mu.Unlock()
	return slices.ContainsFunc(l.msgs, func(m string) bool { return strings.Contains(m, s) })
}

// memberRevision is the mod revision of id's record (0 when there is none).
func memberRevision(t *testing.T, cli *clientv3.Client, id string) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), memberKey(defaultPrefix, id))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].ModRevision
}

// writes reports whether m's agent lets a secret be written now.
func (m *member) writes() bool {
	_, err := m.agent.TransformerForResource(secrets).TransformToStorage(context.Background(), []byte("x"), value.DefaultContext("/registry/secrets/ns/x"))
	return err == nil
}

// TestPauseLongerThanTheLeaseHoldsWrites: when the injected clock steps past the lease
// TTL (a paused process or VM), the node holds every write, publishes its record again,
// and lets writes through once its view includes that record.
func TestPauseLongerThanTheLeaseHoldsWrites(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	clk := testingclock.NewFakeClock(epoch)
	rec := &eventLog{}
	a := startMember(t, cli, "a", secretsConfig("k1"), shortLease, func(o *Options) { o.Clock, o.Events = clk, rec })
	eventually(t, "a ready", func() bool { return a.node.ReadyzCheck().Check(nil) == nil && a.writes() })
	before := memberRevision(t, cli, "a")

	clk.Step(3 * time.Second) // the lease is 2 s
	eventually(t, "writes held, naming the pause", func() bool {
		return rec.has("writes of secrets are held: this apiserver did not run for 3s, longer than its 2s member lease")
	})
	eventually(t, "writes resume once the record is back in the view", func() bool {
		return a.writes() && a.node.ReadyzCheck().Check(nil) == nil
	})
	if after := memberRevision(t, cli, "a"); after <= before {
		t.Fatalf("the record was not published again after the pause (mod revision %d, before %d)", after, before)
	}
	if held, _, _ := a.node.fence.Resync(); held {
		t.Fatal("the fence still resynchronises")
	}
}

// TestWriteGateHoldsWritesTheMomentAPausedProcessRuns: after a pause longer than the
// lease, a write served before the node's clock goroutine ran again (the fence does not
// know of the pause yet) is refused with 503 and Retry-After; the gate opens at that
// goroutine's next step, when the fence has taken over (TestPauseLongerThanTheLease…).
func TestWriteGateHoldsWritesTheMomentAPausedProcessRuns(t *testing.T) {
	clk := testingclock.NewFakePassiveClock(epoch)
	n := &Node{opts: Options{Clock: testingclock.NewFakeClock(epoch), LeaseTTL: 2 * time.Second}}
	n.opts.Clock = passiveWithTicker{clk, n.opts.Clock}
	if err := n.WriteGate(); err != nil {
		t.Fatalf("WriteGate before Start = %v; want nil", err)
	}
	stepped := epoch
	n.ticked.Store(&stepped)
	clk.SetTime(epoch.Add(1900 * time.Millisecond))
	if err := n.WriteGate(); err != nil {
		t.Fatalf("WriteGate within the lease = %v; want nil", err)
	}
	clk.SetTime(epoch.Add(2500 * time.Millisecond)) // the process was stopped
	var refused *transformers.WriteRefusedError
	if err := n.WriteGate(); !errors.As(err, &refused) || refused.RetryAfter <= 0 ||
		!strings.Contains(refused.Reason, "did not run for 2.5s, longer than its 2s member lease") {
		t.Fatalf("WriteGate right after a pause = %v; want a refusal with Retry-After naming the pause", err)
	}
	stepped = clk.Now() // watchPauses ran: the fence holds from now on
	n.ticked.Store(&stepped)
	if err := n.WriteGate(); err != nil {
		t.Fatalf("WriteGate after the clock goroutine stepped = %v; want nil (the fence decides)", err)
	}
}

// passiveWithTicker reads the time from a passive fake clock (which fires nothing when
// set) and hands out tickers of another.
type passiveWithTicker struct {
	*testingclock.FakePassiveClock
	clock.WithTicker
}

func (p passiveWithTicker) Now() time.Time                  { return p.FakePassiveClock.Now() }
func (p passiveWithTicker) Since(t time.Time) time.Duration { return p.FakePassiveClock.Since(t) }

// TestLostLeaseHoldsWrites: when the member lease ends (here: revoked behind the
// node's back), the node holds every write until its record is back in its view, under
// a new lease.
func TestLostLeaseHoldsWrites(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	rec := &eventLog{}
	a := startMember(t, cli, "a", secretsConfig("k1"), func(o *Options) { o.Events = rec })
	leaseOf := func() clientv3.LeaseID {
		a.node.pub.mu.Lock()
		defer a.node.pub.mu.Unlock()
		if a.node.pub.session == nil {
			return clientv3.NoLease
		}
		return a.node.pub.session.Lease()
	}
	eventually(t, "a ready and published", func() bool {
		return a.node.ReadyzCheck().Check(nil) == nil && a.writes() && leaseOf() != clientv3.NoLease
	})
	lease := leaseOf()

	if _, err := cli.Revoke(context.Background(), lease); err != nil {
		t.Fatal(err)
	}
	eventually(t, "writes held, naming the lost lease", func() bool {
		return rec.has("writes of secrets are held: its member lease ended")
	})
	eventually(t, "writes resume once the record is back in the view, under a new lease", func() bool {
		l := leaseOf()
		return a.writes() && a.node.ReadyzCheck().Check(nil) == nil && memberRevision(t, cli, "a") != 0 && l != clientv3.NoLease && l != lease
	})
}

// TestReadinessFailsWhileTheViewIsOlderThanTheLease: a node whose watch has confirmed
// nothing for longer than the lease TTL is not ready, saying how old its view is; the
// progress it asks an idle watch for makes it current, and ready, again.
func TestReadinessFailsWhileTheViewIsOlderThanTheLease(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	clk := testingclock.NewFakeClock(epoch)
	a := startMember(t, cli, "a", secretsConfig("k1"), shortLease, func(o *Options) { o.Clock = clk })
	eventually(t, "a ready, its record in its view", func() bool {
		return a.node.ReadyzCheck().Check(nil) == nil && memberIDs(a.node.view) == "a"
	})

	// Nothing changes, and the watch has said nothing for 2.5 s.
	a.node.view.mu.Lock()
	a.node.view.freshAt = clk.Now().Add(-2500 * time.Millisecond)
	a.node.view.mu.Unlock()
	err := a.node.ReadyzCheck().Check(nil)
	for _, want := range []string{"view of the live apiservers under /rekey/members/ was last known current 2.5s ago, longer than its 2s lease", "waiting for the watch to catch up"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("readiness with a view older than the lease: %v; want %q", err, want)
		}
	}
	clk.Step(a.node.view.progressEvery) // the view asks the idle watch for progress
	eventually(t, "ready once the watch confirmed the view", func() bool { return a.node.ReadyzCheck().Check(nil) == nil })
}
