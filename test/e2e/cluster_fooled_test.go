package e2e

// The cluster fence must not be fooled (a key is its secret, a member is a live
// apiserver of this cluster): on the 3-apiserver testbed (3-member etcd, three shims
// with --cluster-coordination, the file syncer, writers and the sampler running),
// each way an operator can meet on a normal day:
//
//	(a) three `rekey rotate` runs on three per-node files in the same second
//	(b) a member down through a complete rotation, back with its pre-rotation file
//	(c) a second cluster with another --etcd-prefix on the same etcd
//	(d) a leftover member record without a lease
//	(e) an 80 KB broken config file on one node
//	(f) the source reverted during a rotation
//	(g) KMS: one node's plugin lags a key id and its apiserver restarts during the hold
//
// Invariants everywhere: no unreadable read on a ready member (a load balancer's
// health check takes members out while /readyz fails, and a failed request is
// excused only if the member says it is not ready when asked right after), no lost
// write, the other members stay ready in (b)–(e), and the cluster converges once the
// files agree. (b) and (e) run by default; the others with E2E_LONG=1 (make e2e-long).
//
// BenchmarkClusterFenceDecision measures the fence decision latency and the member
// record size (docs/bench/appendix.md).

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

// requireLong skips a scenario of the long set unless E2E_LONG=1.
func requireLong(t testing.TB) {
	t.Helper()
	if !e2eLong() {
		t.Skip("set E2E_LONG=1 (make e2e-long) to run this scenario")
	}
}

// fooledObjects is the number of Secrets the scenarios seed (CLUSTER_OBJECTS, default 200).
func fooledObjects() int { return envInt("CLUSTER_OBJECTS", 200) }

// fooledConfig is the scenarios' bed: coordinated shims, file updates within 2 s.
func fooledConfig(name string) bedConfig {
	return bedConfig{name: name, objects: fooledObjects(), coordination: true, maxDelay: 2 * time.Second}
}

// readyLoad is a workload behind a load balancer that follows /readyz.
type readyLoad struct {
	*clusterLoad
	lb *testbed.LoadBalancer
}

// startReadyLoad starts the load balancer, writers and sampler; failed requests on a
// member that is not ready are excused.
func (b *clusterBed) startReadyLoad() *readyLoad {
	ctx := b.t.Context()
	lb := b.fleet.StartLoadBalancer(ctx, 200*time.Millisecond)
	b.t.Cleanup(lb.Stop)
	return &readyLoad{lb: lb, clusterLoad: &clusterLoad{
		raftTerm: b.raftTerm(),
		writers:  b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50, ExcuseNotReady: true}),
		sampler:  b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200, ExcuseNotReady: true}),
	}}
}

// stayedReady fails the test for every shim of ids the load balancer saw not ready
// since the last call.
func (l *readyLoad) stayedReady(t testing.TB, what string, ids ...string) {
	t.Helper()
	for _, id := range ids {
		if got := l.lb.NotReady(id); len(got) > 0 {
			t.Errorf("%s: %s was not ready %d times, e.g. %v", what, id, len(got), first(got, 3))
		}
	}
}

// storedOnlyFor checks for d that every Secret stays stored under one of allowed.
func (b *clusterBed) storedOnlyFor(d time.Duration, why string, allowed ...string) {
	t := b.t
	t.Helper()
	for deadline := time.Now().Add(d); time.Now().Before(deadline); time.Sleep(200 * time.Millisecond) {
		got, err := testbed.StoredPrefixes(t.Context(), b.cli, b.secretsKey)
		if err != nil {
			t.Fatal(err)
		}
		for p, n := range got {
			if !slices.Contains(allowed, p) {
				t.Fatalf("%s: %d Secrets stored under %s (%v), want only %v", why, n, p, got, allowed)
			}
		}
	}
}

// applyTo writes content to the files of the shims only (by index) through the
// syncer and waits for the round.
func (b *clusterBed) applyTo(content []byte, only ...int) time.Time {
	t := b.t
	t.Helper()
	last, err := b.syncer.ApplyEach(t.Context(), func(int) []byte { return content }, only).Wait(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	return last
}

func shimsOf(f *testbed.Fleet, idx ...int) []*testbed.Shim {
	var out []*testbed.Shim
	for _, i := range idx {
		out = append(out, f.Shims[i].Current())
	}
	return out
}

func (b *clusterBed) idsOf(idx ...int) []string {
	var out []string
	for _, i := range idx {
		out = append(out, b.fleet.Shims[i].ID)
	}
	return out
}

func storedKey(name string) string { return "k8s:enc:aesgcm:v1:" + name + ":" }

// (a) Three `rekey rotate` runs on the three per-node files in the same second: each
// generates its own secret, so the names must differ, nobody promotes a key the others
// cannot read, and once an operator copies one file to every node the cluster moves to
// that key.
func TestClusterFooledParallelRotate(t *testing.T) {
	requireClusterShim(t)
	requireLong(t)
	bin := rekeyBin(t)
	b := newClusterBed(t, bedConfig{name: "fooled-a", objects: fooledObjects(), coordination: true,
		syncMode: testbed.SyncRename, maxDelay: 2 * time.Second})
	ctx := t.Context()
	l := b.startReadyLoad()
	paths := b.fleet.ConfigPaths()
	// Start the three in the same UTC second, as an ansible loop over three nodes does.
	time.Sleep(time.Until(time.Now().Truncate(time.Second).Add(time.Second + 50*time.Millisecond)))
	outs := make([][]byte, len(paths))
	errs := make([]error, len(paths))
	var wg sync.WaitGroup
	for i, p := range paths {
		wg.Go(func() {
			outs[i], errs[i] = exec.CommandContext(ctx, bin, "rotate", "--encryption-provider-config", p).CombinedOutput()
		})
	}
	wg.Wait()
	var names []string
	for i, p := range paths {
		t.Logf("rekey rotate on %s:\n%s", b.fleet.Shims[i].ID, outs[i])
		if errs[i] != nil {
			t.Fatalf("rekey rotate on %s: %v", p, errs[i])
		}
		keys := sourceKeys(t, p)
		if len(keys) != 2 || keys[1] != "key1" {
			t.Fatalf("%s: keys %v, want [<new> key1]", p, keys)
		}
		names = append(names, keys[0])
	}
	t.Logf("generated names: %v", names)
	clash := false
	for i := range names {
		for j := i + 1; j < len(names); j++ {
			if strings.HasPrefix(names[i], names[j]) || strings.HasPrefix(names[j], names[i]) {
				clash = true
				t.Errorf("generated names %q and %q: one is a prefix of the other (same name, different secrets)", names[i], names[j])
			}
		}
	}
	// Nobody can promote a key the two others cannot read: everything stays on key1.
	b.storedOnlyFor(8*time.Second, "three different secrets configured", stored1)
	if clash {
		// Same name, different secret: a conflict, and readiness fails on the members
		// involved (here all three) until their files agree.
		for _, id := range b.ids() {
			if len(l.lb.NotReady(id)) == 0 {
				t.Errorf("%s stayed ready with the same key name as the others under another secret", id)
			}
		}
	} else {
		l.stayedReady(t, "three different new keys configured", b.ids()...)
	}

	// The files agree: node 0's file everywhere.
	agreed, err := os.ReadFile(paths[0])
	if err != nil {
		t.Fatal(err)
	}
	b.applyTo(agreed, 1, 2)
	b.waitConverged("every object on node 0's new key", 60*time.Second, agreed,
		testbed.StoredUnderProbe(b.cli, b.secretsKey, storedKey(names[0])))
	if clash {
		for _, id := range b.ids() {
			l.lb.NotReady(id) // the conflict's own readiness failures, until the files agreed
		}
	}
	secrets := fileSecrets(t, paths[0])
	b.dropAndCheck(testbed.SecretsConfig(testbed.AESGCM(testbed.NamedKey{Name: names[0], Secret: secrets[0]})))
	b.finish(l.clusterLoad)
	l.stayedReady(t, "the rotation", b.ids()...)
}

// (b) A member down through a complete rotation key1 → key2 (key1 dropped) comes back
// with its pre-rotation file [key1]: it is not ready and serves no write (503, never
// data nobody else can read), the others stay ready, and once its file catches up it
// is ready by itself.
func TestClusterFooledStragglerOldFile(t *testing.T) {
	requireClusterShim(t)
	b := newClusterBed(t, fooledConfig("fooled-b"))
	ctx := t.Context()
	l := b.startReadyLoad()
	straggler := b.fleet.Shims[2]
	others := b.idsOf(0, 1)
	straggler.Stop(15 * time.Second)

	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	only2 := to2.WithoutKey("key1")
	b.applyTo(to2.Render(), 0, 1)
	b.waitConverged("every object on key2 while "+straggler.ID+" is down", 60*time.Second, to2.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.applyTo(only2.Render(), 0, 1)
	wctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.ConfigAppliedProbe(b.shims(), only2.Render(), nil)); err != nil {
		t.Fatalf("dropping key1 on %v: %v", others, err)
	}
	l.stayedReady(t, "the rotation", others...)

	// Back with [key1].
	if err := straggler.Launch(ctx); err != nil {
		t.Fatal(err)
	}
	c, err := straggler.Client()
	if err != nil {
		t.Fatal(err)
	}
	var writeErr error
	for deadline := time.Now().Add(8 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if err := straggler.Current().Readyz(ctx); err == nil {
			doc, _ := straggler.Current().Status(ctx)
			t.Fatalf("%s is ready with a file that cannot read key2; its status document:\n%s", straggler.ID, doc.Raw)
		}
		rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
		_, writeErr = c.CoreV1().Secrets(b.load.Namespace).Create(rctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{GenerateName: "through-straggler-"}, Data: map[string][]byte{"v": []byte("x")}}, metav1.CreateOptions{})
		rcancel()
		if writeErr == nil {
			t.Fatalf("%s accepted a write with its file [key1], which no other member can read", straggler.ID)
		}
	}
	if !apierrors.IsServiceUnavailable(writeErr) || !strings.Contains(writeErr.Error(), "key2") {
		t.Errorf("a write through %s: %v, want 503 naming the key it lacks (key2)", straggler.ID, writeErr)
	}
	if got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey); err != nil || got[stored1] != 0 {
		t.Fatalf("stored under key1 after %s came back with its old file: %v (%v)", straggler.ID, got, err)
	}
	l.stayedReady(t, straggler.ID+" back with [key1]", others...)

	// Its file catches up: ready by itself.
	b.applyTo(only2.Render(), 2)
	rctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := straggler.WaitReady(rctx); err != nil {
		t.Fatalf("%s with the final file [key2]: %v", straggler.ID, err)
	}
	b.waitConverged("converged with "+straggler.ID+" back", 30*time.Second, only2.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.finish(l.clusterLoad)
	l.stayedReady(t, straggler.ID+" catching up", others...)
}

// (c) A second cluster on the same etcd with another --etcd-prefix, both with the
// default coordination prefix and the same key name (key1) with another secret: the
// first cluster rotates to key2 as if the other did not exist, its members stay ready,
// and the other cluster's data stays readable and on its own key1.
func TestClusterFooledSecondCluster(t *testing.T) {
	requireClusterShim(t)
	requireLong(t)
	b := newClusterBed(t, bedConfig{name: "fooled-c", objects: fooledObjects(), coordination: true,
		defaultCoordination: true, maxDelay: 2 * time.Second})
	ctx := t.Context()
	const otherPrefix = "/fooled-c-other"
	otherKey := testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()}
	other, err := testbed.StartFleet(ctx, testbed.FleetConfig{ShimBin: bins.Shim, Dir: t.TempDir(), N: 1,
		EtcdServers: b.etcd.Endpoints(), EtcdPrefix: otherPrefix, IDPrefix: "other",
		Config: testbed.SecretsConfig(testbed.AESGCM(otherKey)).Render(),
		Args: []string{"--storage-migration-check-interval", "250ms", "--cluster-coordination=true",
			"--cluster-lease-ttl", "3s"},
		NoAPIServerID: !shimKnows(t, "--apiserver-id")})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("other cluster's shim log:\n%s", other.LogTails(3000))
		}
		other.Stop()
	})
	otherLoad := testbed.NewWorkload("other", other.Endpoints())
	if err := otherLoad.Seed(ctx, "o", 50, 4); err != nil {
		t.Fatal(err)
	}
	l := b.startReadyLoad()
	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	b.applyTo(to2.Render())
	b.waitConverged("every object on key2 with another cluster on the etcd", 60*time.Second, to2.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.dropAndCheck(to2.WithoutKey("key1"))
	b.finish(l.clusterLoad)
	l.stayedReady(t, "a second cluster on the etcd", b.ids()...)
	if err := other.Shims[0].Current().Readyz(ctx); err != nil {
		t.Errorf("the other cluster's apiserver: %v", err)
	}
	rep, err := otherLoad.Verify(ctx, other.Shims[0])
	if err != nil || !rep.OK() || rep.Objects != otherLoad.Objects() {
		t.Errorf("the other cluster's data: %s (%v)", rep, err)
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, otherPrefix+"/secrets/", stored1); err != nil {
		t.Errorf("the other cluster's data: %v", err)
	}
}

// (d) A member record left under the coordination prefix without a lease (it never
// expires), writing with a key nobody has: it never counts against anyone's readiness,
// it holds promotions (fail closed), `rekey status` lists it as unknown, and once it is
// removed the rotation goes on.
func TestClusterFooledLeftoverRecord(t *testing.T) {
	requireClusterShim(t)
	requireLong(t)
	b := newClusterBed(t, fooledConfig("fooled-d"))
	ctx := t.Context()
	l := b.startReadyLoad()
	members, err := testbed.ReadMembers(ctx, b.cli, b.coord)
	if err != nil {
		t.Fatal(err)
	}
	var rec map[string]any
	if err := json.Unmarshal(members[b.ids()[0]], &rec); err != nil {
		t.Fatal(err)
	}
	const ghost = "ghost-apiserver"
	rec["apiserverID"] = ghost
	ghostKey := map[string]any{"provider": "aesgcm", "key": "key0"}
	resources, _ := rec["resources"].([]any)
	for _, r := range resources {
		if m, ok := r.(map[string]any); ok {
			m["write"], m["read"] = ghostKey, []any{ghostKey}
		}
	}
	data, err := json.Marshal(rec)
	if err != nil {
		t.Fatal(err)
	}
	ghostAt := testbed.MembersKey(b.coord, ghost)
	if _, err := b.cli.Put(ctx, ghostAt, string(data)); err != nil {
		t.Fatal(err)
	}
	t.Logf("put a record without a lease at %s", ghostAt)
	time.Sleep(6 * time.Second) // two lease TTLs: a leased record would be gone
	l.stayedReady(t, "a leftover record writing with key0", b.ids()...)

	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	b.applyTo(to2.Render())
	b.storedOnlyFor(8*time.Second, "an unknown member under the coordination prefix holds promotions", stored1)
	out, err := runRekey(t, "status", "--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--etcd-prefix", b.prefix,
		"--coordination-prefix", b.coord)
	if !strings.Contains(out, ghost) || !strings.Contains(strings.ToLower(out), "unknown") {
		t.Errorf("rekey status (%v) does not list %s as an unknown member", err, ghost)
	}
	l.stayedReady(t, "a rotation held by a leftover record", b.ids()...)

	if _, err := b.cli.Delete(ctx, ghostAt); err != nil {
		t.Fatal(err)
	}
	b.waitConverged("every object on key2 once the leftover record is gone", 60*time.Second, to2.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.dropAndCheck(to2.WithoutKey("key1"))
	b.finish(l.clusterLoad)
	l.stayedReady(t, "the rotation", b.ids()...)
}

// brokenConfig is an EncryptionConfiguration of about size bytes that fails
// validation once per key: a long list of errors.
func brokenConfig(size int) []byte {
	var s strings.Builder
	s.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" +
		"- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n")
	for i := 0; s.Len() < size; i++ {
		fmt.Fprintf(&s, "      - {name: broken-%05d, secret: \"this is not a base64 encoded key %05d\"}\n", i, i)
	}
	return []byte(s.String())
}

// recordSize is the size in bytes of member id's record, and its lastReloadError.
func (b *clusterBed) recordSize(ctx context.Context, id string) (int, string, error) {
	resp, err := b.cli.Get(ctx, testbed.MembersKey(b.coord, id))
	if err != nil {
		return 0, "", err
	}
	if len(resp.Kvs) == 0 {
		return 0, "", fmt.Errorf("no member record at %s", testbed.MembersKey(b.coord, id))
	}
	var m struct {
		LastReloadError string `json:"lastReloadError"`
	}
	_ = json.Unmarshal(resp.Kvs[0].Value, &m)
	return len(resp.Kvs[0].Value), m.LastReloadError, nil
}

// (e) An 80 KB broken file on one node: it keeps serving its old file, stays a
// published member with a bounded record (its error cut to at most 1 KiB), so the
// fence keeps holding a key it cannot read; the others stay ready; once its file is
// fixed the cluster converges.
func TestClusterFooledBrokenFile(t *testing.T) {
	requireClusterShim(t)
	b := newClusterBed(t, fooledConfig("fooled-e"))
	ctx := t.Context()
	l := b.startReadyLoad()
	broken := b.fleet.Shims[1]
	others := b.idsOf(0, 2)
	normal, _, err := b.recordSize(ctx, broken.ID)
	if err != nil {
		t.Fatal(err)
	}
	before, err := testbed.FailedReloads(ctx, b.shims())
	if err != nil {
		t.Fatal(err)
	}
	bad := brokenConfig(80 << 10)
	b.applyTo(bad, 1)
	wctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.StatusProbe(shimsOf(b.fleet, 1), func(s *testbed.Shim, doc testbed.StatusDoc) error {
		if doc.ReloadsFailed > before[s.Name] {
			return nil
		}
		return fmt.Errorf("%d failed reloads", doc.ReloadsFailed)
	})); err != nil {
		t.Fatalf("the %d-byte broken file was not refused: %v", len(bad), err)
	}
	// Published, bounded, for longer than a lease TTL.
	var size int
	var published string
	for deadline := time.Now().Add(6 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if size, published, err = b.recordSize(ctx, broken.ID); err != nil {
			t.Fatalf("%s with a %d-byte broken file: %v (it vanished from the cluster while serving)", broken.ID, len(bad), err)
		}
	}
	t.Logf("member record of %s: %d bytes serving normally, %d bytes with the %d-byte broken file (lastReloadError %d bytes)",
		broken.ID, normal, size, len(bad), len(published))
	if published == "" || len(published) > 1024+64 || size > 16<<10 {
		t.Errorf("member record of %s: %d bytes, lastReloadError %d bytes: want the error published, cut to 1 KiB plus a count",
			broken.ID, size, len(published))
	}
	l.stayedReady(t, "a broken file on "+broken.ID, others...)

	// The fence holds key2 for the member still serving [key1].
	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	b.applyTo(to2.Render(), 0, 2)
	b.storedOnlyFor(8*time.Second, broken.ID+" serves [key1] behind its broken file", stored1)
	b.applyTo(to2.Render(), 1)
	b.waitConverged("every object on key2 once the file is fixed", 60*time.Second, to2.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.finish(l.clusterLoad)
	l.stayedReady(t, "the rotation", others...)
}

// (f) The source reverted during a rotation: [key2, key1] has reached nodes 0 and 1,
// and at the same moment node 0 gets the revert [key1] while node 2 gets [key2, key1]
// (the last copy the fence waited for, so a promotion may happen right then); then the
// revert reaches every node. No key a member writes with (or holds) is dropped
// anywhere; the operator's correction [key1, key2] is accepted everywhere and the
// cluster converges on key1.
func TestClusterFooledRevertDuringRotation(t *testing.T) {
	requireClusterShim(t)
	requireLong(t)
	b := newClusterBed(t, fooledConfig("fooled-f"))
	ctx := t.Context()
	l := b.startReadyLoad()
	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	revert := testbed.SecretsConfig(testbed.AESGCM(b.key1))
	b.applyTo(to2.Render(), 0, 1)
	wctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 20*time.Millisecond, testbed.ConfigAppliedProbe(shimsOf(b.fleet, 0, 1), to2.Render(), nil)); err != nil {
		t.Fatal(err)
	}
	// Both at once: no syncer delay.
	now, err := b.fleet.NewSyncer(testbed.SyncerConfig{MinDelay: time.Millisecond, MaxDelay: time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := now.ApplyEach(ctx, func(i int) []byte {
		if i == 0 {
			return revert.Render()
		}
		return to2.Render()
	}, []int{0, 2}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(3 * time.Second)
	b.applyTo(revert.Render(), 1, 2)
	time.Sleep(5 * time.Second)
	got, _ := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey)
	t.Logf("after the revert: stored %v", got)

	back := testbed.SecretsConfig(testbed.AESGCM(b.key1, b.key2))
	actx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.ApplyAndWaitAccepted(actx, b.syncer, b.shims(), back.Render()); err != nil {
		t.Fatalf("the correction [key1, key2] after the revert: %v", err)
	}
	b.waitConverged("every object on key1 after the correction", 60*time.Second, back.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored1))
	b.dropAndCheck(revert)
	b.finish(l.clusterLoad)
	l.stayedReady(t, "a revert during a rotation", b.ids()...)
}

// (g) KMS: the plugins of nodes 0 and 1 get kek-2, node 2's lags with kek-1 only, and
// node 0's apiserver restarts during the hold. Its first seed after the restart must
// not write under kek-2 while node 2's plugin cannot decrypt it: it stays not ready and
// holds writes; once node 2's plugin has kek-2 every node moves to it.
func TestClusterFooledKMSRestartDuringHold(t *testing.T) {
	requireClusterShim(t)
	requireLong(t)
	b := newClusterBed(t, bedConfig{name: "fooled-g", objects: fooledObjects(), coordination: true, plugins: true,
		maxDelay: 2 * time.Second,
		initial: func(b *clusterBed, i int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.KMSv2(kmsName, b.plugins[i].Endpoint))
		}})
	ctx := t.Context()
	wctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-1")); err != nil {
		t.Fatal(err)
	}
	l := b.startReadyLoad()
	kek2 := testbed.PluginKey{Name: "kek-2", Secret: testbed.RandomKey()}
	for _, p := range b.plugins[:2] {
		if err := testbed.WritePluginKeys(p.KeysFile, kek2, b.kek1); err != nil {
			t.Fatal(err)
		}
	}
	// Nodes 0 and 1 hold kek-2 back.
	hctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(hctx, 100*time.Millisecond, testbed.MembersProbe(b.cli, b.coord, b.ids(), func(id string, st json.RawMessage) error {
		if id == b.ids()[2] {
			return nil
		}
		var m struct {
			KMS []struct {
				Held string `json:"heldKeyIDHash"`
			} `json:"kms"`
		}
		if err := json.Unmarshal(st, &m); err != nil {
			return err
		}
		if len(m.KMS) == 0 || m.KMS[0].Held == "" {
			return fmt.Errorf("holds no key id")
		}
		return nil
	})); err != nil {
		t.Fatal(err)
	}
	noKek2 := func(why string) {
		got, err := testbed.StoredKMSKeyIDs(ctx, b.cli, b.secretsKey)
		if err != nil {
			t.Fatal(err)
		}
		for k, n := range got {
			if k != "k8s:enc:kms:v2:"+kmsName+":kek-1" {
				t.Fatalf("%s: %d Secrets stored under %s (%v)", why, n, k, got)
			}
		}
	}
	noKek2("during the hold")

	restarted := b.fleet.Shims[0]
	restarted.Stop(15 * time.Second)
	if err := restarted.Launch(ctx); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if err := restarted.Current().Readyz(ctx); err == nil {
			t.Fatalf("%s is ready after its restart while %s's plugin cannot decrypt kek-2", restarted.ID, b.ids()[2])
		}
		noKek2(restarted.ID + " restarted during the hold")
	}

	if err := testbed.WritePluginKeys(b.plugins[2].KeysFile, kek2, b.kek1); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := contextWithTimeout(t, 60*time.Second)
	defer cancel()
	if err := restarted.WaitReady(rctx); err != nil {
		t.Fatal(err)
	}
	cctx, cancel := contextWithTimeout(t, 90*time.Second)
	defer cancel()
	if err := testbed.WaitFor(cctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-2"),
		testbed.StatusProbe(b.shims(), clusterVerdictConverged)); err != nil {
		t.Fatal(err)
	}
	b.finish(l.clusterLoad)
	l.stayedReady(t, "a restart during a key-id hold", b.idsOf(1, 2)...)
}

// BenchmarkClusterFenceDecision measures, over FENCE_ROTATIONS rotations (default 5)
// on three shims with writers running, the fence decision latency — from the last
// file update of [key(n+1), key(n)] to every member publishing key(n+1) as its write
// key — and the size in bytes of the member records at <prefix>/members/<id>:
//
//	go test -count=1 -run '^$' -bench ClusterFenceDecision -benchtime 1x ./test/e2e
//
// FENCE_SHIMS sets the number of apiservers (default 3): with FENCE_SHIMS=10 it is the
// many-apiservers measurement, which also reports the time to "migration verified" and
// how many member-watch events one change costs.
func BenchmarkClusterFenceDecision(bb *testing.B) {
	requireClusterShim(bb)
	for range bb.N {
		r := measureFenceDecision(bb, envInt("FENCE_ROTATIONS", 5))
		bb.ReportMetric(median(r.promoted).Seconds(), "s-fence-decision-median")
		bb.ReportMetric(slices.Max(r.promoted).Seconds(), "s-fence-decision-max")
		bb.ReportMetric(median(r.verified).Seconds(), "s-verified-median")
		bb.ReportMetric(slices.Max(r.verified).Seconds(), "s-verified-max")
		bb.ReportMetric(float64(median(r.watchEvents)), "member-watch-events-per-change")
		bb.ReportMetric(float64(r.recordBytes), "bytes-member-record")
	}
}

// fenceMeasurement is what measureFenceDecision saw, one entry per rotation: the time
// from the last file update to every member writing with the new key (promoted) and to
// every object under it with every member converged (verified), the member-key watch
// events in between (watchEvents), and the largest member record seen.
type fenceMeasurement struct {
	promoted, verified []time.Duration
	watchEvents        []int
	recordBytes        int
}

func measureFenceDecision(t testing.TB, rotations int) fenceMeasurement {
	shims := envInt("FENCE_SHIMS", 3)
	b := newClusterBed(t, bedConfig{name: "fence-latency", shims: shims, objects: fooledObjects(), coordination: true, maxDelay: 2 * time.Second})
	l := b.startLoad()
	// Every event on the member keys, as each member's own watch sees them.
	var watchEvents atomic.Int64
	wctx, stopWatch := context.WithCancel(t.Context())
	defer stopWatch()
	go func() {
		for resp := range b.cli.Watch(wctx, testbed.MembersKey(b.coord, ""), clientv3.WithPrefix()) {
			watchEvents.Add(int64(len(resp.Events)))
		}
	}()
	keys := []testbed.NamedKey{b.key1}
	var m fenceMeasurement
	lat := &m.promoted
	maxSize := 0
	for n := range rotations {
		before := watchEvents.Load()
		next := testbed.NamedKey{Name: fmt.Sprintf("key%d", n+2), Secret: testbed.RandomKey()}
		cur := keys[len(keys)-1]
		keys = append(keys, next)
		edit := testbed.SecretsConfig(testbed.AESGCM(next, cur))
		last := b.applyTo(edit.Render())
		pctx, cancel := contextWithTimeout(t, 60*time.Second)
		var promoted time.Time
		for promoted.IsZero() {
			members, err := testbed.ReadMembers(pctx, b.cli, b.coord)
			if err != nil {
				cancel()
				t.Fatalf("waiting for every member to write with %s: %v", next.Name, err)
			}
			all := len(members) == len(b.fleet.Shims)
			for _, raw := range members {
				maxSize = max(maxSize, len(raw))
				var m struct {
					Resources []struct {
						Resource string `json:"resource"`
						Write    struct {
							Key string `json:"key"`
						} `json:"write"`
					} `json:"resources"`
				}
				if json.Unmarshal(raw, &m) != nil || len(m.Resources) == 0 || m.Resources[0].Write.Key != next.Name {
					all = false
				}
			}
			if all {
				promoted = time.Now()
			} else {
				time.Sleep(10 * time.Millisecond)
			}
		}
		cancel()
		*lat = append(*lat, promoted.Sub(last))
		t.Logf("rotation %d: %s promoted %v after the last file update", n+1, next.Name, promoted.Sub(last).Round(time.Millisecond))
		verified := b.waitConverged("every object on "+next.Name, 60*time.Second, edit.Render(),
			testbed.StoredUnderProbe(b.cli, b.secretsKey, storedKey(next.Name)))
		m.verified = append(m.verified, verified.Sub(last))
		m.watchEvents = append(m.watchEvents, int(watchEvents.Load()-before))
		t.Logf("rotation %d: verified %v after the last file update; %d member-watch events (%d apiservers)",
			n+1, verified.Sub(last).Round(time.Millisecond), m.watchEvents[n], shims)
	}
	members, err := testbed.ReadMembers(t.Context(), b.cli, b.coord)
	if err != nil {
		t.Fatal(err)
	}
	var atRest []int
	for _, raw := range members {
		atRest = append(atRest, len(raw))
	}
	b.finish(l)
	t.Logf("fence decision: median %v, max %v over %d rotations; member records: largest seen %d bytes, converged %v bytes",
		median(*lat).Round(time.Millisecond), slices.Max(*lat).Round(time.Millisecond), rotations, maxSize, atRest)
	m.recordBytes = maxSize
	return m
}
