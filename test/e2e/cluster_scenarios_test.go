package e2e

// Many apiservers, one cluster: a 3-member etcd cluster of
// processes, three shims each with its own copy of the encryption config, a file
// syncer that applies every change to each copy after its own random delay (0–10 s,
// as kubelets refresh a mounted Secret), writers on every shim and a sampler that
// reads every object through every shim for the whole run.
//
// The scenarios need the shim's cluster coordination (--cluster-coordination); they
// skip with a message when the shim binary does not have it. The delays replay with
// CLUSTER_SEED=<seed from the log>; CLUSTER_OBJECTS sets the number of Secrets
// (default 1,000). The 10,000-object measurement:
//
//	go test -count=1 -run '^$' -bench ClusterOneEdit -benchtime 1x ./test/e2e

import (
	"context"
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// shimFlags caches which flags the built shim binary knows.
var shimFlags struct {
	once sync.Once
	help string
	err  error
}

// shimKnows reports whether the shim binary's --help lists flag.
func shimKnows(t testing.TB, flag string) bool {
	t.Helper()
	shimFlags.once.Do(func() {
		out, err := exec.Command(bins.Shim, "--help").CombinedOutput()
		shimFlags.help, shimFlags.err = string(out), err
	})
	if shimFlags.err != nil {
		t.Fatalf("%s --help: %v\n%s", bins.Shim, shimFlags.err, shimFlags.help)
	}
	return strings.Contains(shimFlags.help, flag+" ") || strings.Contains(shimFlags.help, flag+"=")
}

// requireClusterShim skips the test until the shim has cluster coordination.
func requireClusterShim(t testing.TB) {
	t.Helper()
	if !shimKnows(t, "--cluster-coordination") {
		t.Skip("the apiserver-shim binary has no --cluster-coordination flag (pkg/cluster is not wired into the shim yet): " +
			"the many-apiserver scenarios need it")
	}
}

// clusterSeed is CLUSTER_SEED, or 0 (the syncer then picks one from the clock and
// logs it).
func clusterSeed(t testing.TB) uint64 {
	s := os.Getenv("CLUSTER_SEED")
	if s == "" {
		return 0
	}
	n, err := strconv.ParseUint(s, 10, 64)
	if err != nil {
		t.Fatalf("CLUSTER_SEED=%q: %v", s, err)
	}
	return n
}

// Names of keys and prefixes the scenarios use.
const (
	stored1 = "k8s:enc:aesgcm:v1:key1:"
	stored2 = "k8s:enc:aesgcm:v1:key2:"
	stored3 = "k8s:enc:aesgcm:v1:key3:"
	kmsName = "cluster-kms"
)

// bedConfig configures a clusterBed.
type bedConfig struct {
	name        string // prefixes in etcd: /<name> and /rekey-<name>
	shims       int    // default 3
	etcdMembers int    // default 3
	objects     int    // Secrets created before the load starts
	// initial is shim i's first config (default key1 only).
	initial func(b *clusterBed, i int) testbed.EncryptionConfig
	// plugins starts one KMS plugin per shim, all with the keyring kek-1.
	plugins bool
	// coordination passes the cluster flags; false passes --cluster-coordination=false
	// when the shim knows it and nothing otherwise.
	coordination bool
	// defaultCoordination leaves --coordination-prefix off (the shims' default);
	// b.coord is then empty.
	defaultCoordination bool
	// syncMode is the layout of the shims' config files (default the kubelet's).
	syncMode testbed.SyncMode
	// etcdLeaderLoss excuses the writes etcd fails while it elects a new leader (the
	// scenario stops etcd's leader).
	etcdLeaderLoss bool
	args           []string
	minDelay       time.Duration
	maxDelay       time.Duration // default 10 s
}

// clusterBed is a running testbed: etcd cluster, shims, syncer, workload.
type clusterBed struct {
	t       testing.TB
	cfg     bedConfig
	etcd    *testbed.EtcdCluster
	cli     *clientv3.Client
	fleet   *testbed.Fleet
	syncer  *testbed.FileSyncer
	load    *testbed.Workload
	plugins []*testbed.Plugin
	kek1    testbed.PluginKey
	key1    testbed.NamedKey
	key2    testbed.NamedKey
	key3    testbed.NamedKey
	// prefix is --etcd-prefix, coord --coordination-prefix.
	prefix, coord string
	// secretsKey is the etcd key prefix of the Secrets.
	secretsKey string
}

func newClusterBed(t testing.TB, cfg bedConfig) *clusterBed {
	t.Helper()
	ctx := t.Context()
	if cfg.shims == 0 {
		cfg.shims = 3
	}
	if cfg.etcdMembers == 0 {
		cfg.etcdMembers = 3
	}
	if cfg.maxDelay == 0 {
		cfg.maxDelay = 10 * time.Second
	}
	b := &clusterBed{t: t, cfg: cfg,
		key1:   testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()},
		key2:   testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()},
		key3:   testbed.NamedKey{Name: "key3", Secret: testbed.RandomKey()},
		kek1:   testbed.PluginKey{Name: "kek-1", Secret: testbed.RandomKey()},
		prefix: "/" + cfg.name, coord: "/rekey-" + cfg.name}
	b.secretsKey = b.prefix + "/secrets/"
	dir := t.TempDir()

	start := time.Now()
	var err error
	if b.etcd, err = testbed.StartEtcdCluster(ctx, bins.Etcd, filepath.Join(dir, "etcd"), cfg.etcdMembers); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			for _, m := range b.etcd.Members {
				if p := m.Process(); p != nil {
					t.Logf("%s log tail:\n%s", m.Name, p.Log(1500))
				}
			}
		}
		b.etcd.Stop()
	})
	if b.cli, err = b.etcd.Client(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.cli.Close() })

	if cfg.plugins {
		sockRoot, err := os.MkdirTemp("", "kms") // unix socket paths are short
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { os.RemoveAll(sockRoot) })
		for i := range cfg.shims {
			pdir := filepath.Join(dir, fmt.Sprintf("plugin-%d", i))
			sock := filepath.Join(sockRoot, strconv.Itoa(i))
			for _, d := range []string{pdir, sock} {
				if err := os.MkdirAll(d, 0o700); err != nil {
					t.Fatal(err)
				}
			}
			p, err := testbed.StartPlugin(ctx, bins.Plugin, pdir, sock, b.kek1)
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { p.Stop(5 * time.Second) })
			b.plugins = append(b.plugins, p)
		}
	}

	initial := cfg.initial
	if initial == nil {
		initial = func(b *clusterBed, _ int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.AESGCM(b.key1))
		}
	}
	args := []string{"--storage-migration-check-interval", "250ms", "--kms-status-interval", "1s"}
	if cfg.coordination {
		args = append(args, "--cluster-coordination=true", "--cluster-lease-ttl", "3s", "--cluster-disagreement-alarm", "2m")
		if cfg.defaultCoordination {
			b.coord = ""
		} else {
			args = append(args, "--coordination-prefix", b.coord)
		}
	} else if shimKnows(t, "--cluster-coordination") {
		args = append(args, "--cluster-coordination=false")
	}
	args = append(args, cfg.args...)
	b.fleet, err = testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: bins.Shim, Dir: filepath.Join(dir, "shims"), N: cfg.shims,
		EtcdServers: b.etcd.Endpoints(), EtcdPrefix: b.prefix,
		ConfigFor:     func(i int) []byte { return initial(b, i).Render() },
		SyncMode:      cfg.syncMode,
		Args:          args,
		NoAPIServerID: !shimKnows(t, "--apiserver-id"),
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("shim logs:\n%s", b.fleet.LogTails(3000))
		}
		b.fleet.Stop()
	})
	if b.syncer, err = b.fleet.NewSyncer(testbed.SyncerConfig{MinDelay: cfg.minDelay, MaxDelay: cfg.maxDelay,
		Seed: clusterSeed(t), Logf: t.Logf}); err != nil {
		t.Fatal(err)
	}

	b.load = testbed.NewWorkload("cluster", b.fleet.Endpoints())
	if cfg.objects > 0 {
		if err := b.load.Seed(ctx, "s", cfg.objects, 8); err != nil {
			t.Fatal(err)
		}
	}
	t.Logf("testbed: %d etcd members, %d shims, %d Secrets in %v", cfg.etcdMembers, cfg.shims, cfg.objects,
		time.Since(start).Round(time.Millisecond))
	return b
}

// shims are the shims running now.
func (b *clusterBed) shims() []*testbed.Shim { return b.fleet.Running() }

// ids are the fleet's apiserver ids.
func (b *clusterBed) ids() []string {
	var out []string
	for _, s := range b.fleet.Shims {
		out = append(out, s.ID)
	}
	return out
}

// clusterLoad is a running workload: writers and sampler.
type clusterLoad struct {
	writers *testbed.Writers
	sampler *testbed.Sampler
	// raftTerm is etcd's raft term when the load started (0: not known).
	raftTerm uint64
}

func (b *clusterBed) startLoad() *clusterLoad {
	return &clusterLoad{
		raftTerm: b.raftTerm(),
		writers: b.load.StartWriters(b.t.Context(), testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50,
			ExcuseEtcdLeaderLoss: b.cfg.etcdLeaderLoss}),
		sampler: b.load.StartSampler(b.t.Context(), testbed.SamplerConfig{Rate: 200}),
	}
}

// finish stops the load and checks the scenarios' criteria: writes were acknowledged on
// every shim in rotation and none failed there, the sampler read through every shim
// with no unreadable, missing or stale read, and every shim in rotation serves every
// object with its last acknowledged write.
func (b *clusterBed) finish(l *clusterLoad) (testbed.WriteReport, testbed.SampleReport) {
	t := b.t
	t.Helper()
	wr := l.writers.Stop()
	sr := l.sampler.Stop()
	t.Logf("writers: %s", wr)
	t.Logf("sampler: %s", sr)
	total := sr.Total()
	// etcd fails the requests in flight while it elects a leader ("leader changed",
	// "request timed out"), and on this shared 2-core machine a member starved of CPU
	// for its election timeout (1 s) can start an election in any scenario. Those
	// failures are etcd's availability, not what the shims stored, so they are excused
	// when etcd's raft term proves an election; without one they fail the scenario.
	failedWrites, badReads := wr.Failed(), total.Bad()
	if leaderLoss := wr.LeaderLoss() + total.LeaderLoss; leaderLoss > 0 {
		if elections := b.electionsSince(l.raftTerm); elections > 0 {
			t.Logf("etcd elected a leader %d time(s) during the load (raft term %d, then %d more): "+
				"excused %d writes and %d reads that failed with its election errors", elections, l.raftTerm, elections,
				wr.LeaderLoss(), total.LeaderLoss)
			failedWrites -= wr.LeaderLoss()
			badReads -= total.LeaderLoss
		} else {
			t.Errorf("%d requests failed with etcd's errors of a leader election, and etcd's raft term says it elected none", leaderLoss)
		}
	}
	if failedWrites > 0 {
		t.Errorf("%d failed writes on shims in rotation, e.g. %v", failedWrites, first(wr.Errors, 3))
	}
	for name, c := range wr.PerEndpoint {
		if c.Acked == 0 {
			t.Errorf("%s: no write acknowledged", name)
		}
	}
	if badReads > 0 {
		t.Errorf("sampler: %d unreadable, %d missing, %d stale, %d other errors; e.g. %v",
			total.Unreadable, total.Missing, total.Stale, total.Errors, first(sr.Examples, 5))
	}
	for name, c := range sr.PerEndpoint {
		if c.Reads == 0 {
			t.Errorf("sampler: nothing read through %s", name)
		}
	}
	b.verifyAll()
	return wr, sr
}

// raftTerm is etcd's raft term now, for electionsSince (0 when it cannot be read).
func (b *clusterBed) raftTerm() uint64 {
	term, err := b.etcd.RaftTerm(b.t.Context())
	if err != nil {
		b.t.Logf("etcd's raft term at the start of the load: %v (a failure in a leader election will not be excused)", err)
	}
	return term
}

// electionsSince is how many leader elections etcd held since it reported the raft
// term before (0 when before or the term now is not known).
func (b *clusterBed) electionsSince(before uint64) uint64 {
	if before == 0 {
		return 0
	}
	now, err := b.etcd.RaftTerm(b.t.Context())
	if err != nil || now < before {
		b.t.Logf("etcd's raft term after the load: %v", err)
		return 0
	}
	return now - before
}

// verifyAll lists the Secrets through every shim in rotation and compares them with
// the writers' record.
func (b *clusterBed) verifyAll() {
	t := b.t
	t.Helper()
	for _, ep := range b.fleet.Endpoints() {
		if !ep.InRotation() {
			continue
		}
		rep, err := b.load.Verify(t.Context(), ep)
		if err != nil {
			t.Errorf("verify: %v", err)
			continue
		}
		if !rep.OK() || rep.Objects < b.load.Objects() {
			t.Errorf("verify: %s (%d acknowledged objects)", rep, b.load.Objects())
		}
	}
}

func first[T any](s []T, n int) []T { return s[:min(n, len(s))] }

// waitConverged waits until every Secret is stored under want (judged from etcd),
// every running shim serves with content, and, with coordination, every shim is a
// published member. It returns the time the wait ended.
func (b *clusterBed) waitConverged(what string, timeout time.Duration, content []byte, storedProbe testbed.Probe) time.Time {
	t := b.t
	t.Helper()
	ctx, cancel := contextWithTimeout(t, timeout)
	defer cancel()
	probes := []testbed.Probe{storedProbe,
		testbed.ConfigAppliedProbe(b.shims(), content, nil)}
	if b.cfg.coordination && b.coord != "" {
		var alive []string
		for _, s := range b.fleet.Shims {
			if s.Alive() {
				alive = append(alive, s.ID)
			}
		}
		probes = append(probes, testbed.MembersProbe(b.cli, b.coord, alive,
			func(string, json.RawMessage) error { return nil }))
	}
	if b.cfg.coordination {
		probes = append(probes, testbed.StatusProbe(b.shims(), clusterVerdictConverged))
	}
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, probes...); err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	return time.Now()
}

// clusterVerdictConverged passes when the status document's cluster section says
// converged, or when there is no such section (the schema belongs to pkg/cluster;
// etcd and the config hashes are the testbed's own evidence).
func clusterVerdictConverged(_ *testbed.Shim, doc testbed.StatusDoc) error {
	var d struct {
		Cluster *struct {
			Verdict *struct {
				Converged bool   `json:"converged"`
				Summary   string `json:"summary"`
			} `json:"verdict"`
		} `json:"cluster"`
	}
	if err := json.Unmarshal(doc.Raw, &d); err != nil {
		return err
	}
	if d.Cluster == nil || d.Cluster.Verdict == nil || d.Cluster.Verdict.Converged {
		return nil
	}
	return fmt.Errorf("cluster verdict: %s", d.Cluster.Verdict.Summary)
}

// dropAndCheck applies cfg (an old key dropped) through the syncer and waits until
// every running shim accepted it, then checks every Secret still reads back.
func (b *clusterBed) dropAndCheck(cfg testbed.EncryptionConfig) {
	t := b.t
	t.Helper()
	ctx, cancel := contextWithTimeout(t, 2*b.cfg.maxDelay+30*time.Second)
	defer cancel()
	if err := testbed.ApplyAndWaitAccepted(ctx, b.syncer, b.shims(), cfg.Render()); err != nil {
		t.Fatalf("dropping the old key: %v", err)
	}
}

// midMigration waits until etcd holds Secrets under both from and to: a migration
// is under way.
func (b *clusterBed) midMigration(from, to string, timeout time.Duration) {
	t := b.t
	t.Helper()
	ctx, cancel := contextWithTimeout(t, timeout)
	defer cancel()
	err := testbed.WaitFor(ctx, 50*time.Millisecond, testbed.Probe{Name: "mid-migration", Check: func(ctx context.Context) error {
		got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey)
		if err != nil {
			return err
		}
		if got[from] > 0 && got[to] > 0 {
			return nil
		}
		return fmt.Errorf("stored %v", got)
	}})
	if err != nil {
		t.Fatalf("waiting for the migration from %s to %s to be under way: %v", from, to, err)
	}
}

func clusterObjects(t testing.TB) int { return envInt("CLUSTER_OBJECTS", 1000) }

// (a) One edit "new local key first": key2 is added before key1 in every copy, each
// copy at its own moment. No shim writes with key2 until all can read it; then all
// data moves to key2, with writers on every shim and nothing unreadable, lost or
// failed; then key1 can be dropped.
func TestClusterOneEditNewKeyFirst(t *testing.T) {
	requireClusterShim(t)
	scenarioOneEdit(t, clusterObjects(t))
}

// BenchmarkClusterOneEdit measures one edit on many apiservers: 10,000 Secrets (CLUSTER_OBJECTS),
// the time from the last file update to every object on key2, verified (local), and
// from the last plugin's keyring update to every object on kek-2, verified (kms; the
// shims' --kms-status-interval is CLUSTER_KMS_STATUS_INTERVAL, default 1s). Each also
// reports the longest write-fence hold any member published and the unreadable reads.
func BenchmarkClusterOneEdit(b *testing.B) {
	requireClusterShim(b)
	b.Run("local", func(b *testing.B) {
		for range b.N {
			r := scenarioOneEdit(b, envInt("CLUSTER_OBJECTS", 10000))
			r.report(b)
		}
	})
	b.Run("kms", func(b *testing.B) {
		for range b.N {
			r := scenarioKeyIDChange(b, envInt("CLUSTER_OBJECTS", 10000), os.Getenv("CLUSTER_KMS_STATUS_INTERVAL"))
			r.report(b)
		}
	})
}

// oneEditResult is what a measured scenario reports.
type oneEditResult struct {
	converged  time.Duration
	maxHold    time.Duration
	unreadable int64
	// spread is the time between the first and the last file update.
	spread time.Duration
}

func (r oneEditResult) report(b *testing.B) {
	b.ReportMetric(r.converged.Seconds(), "s-to-converged")
	b.ReportMetric(r.maxHold.Seconds(), "s-fence-held")
	b.ReportMetric(float64(r.unreadable), "unreadable-reads")
}

// holdTracker polls the published member states and records the longest write-fence
// hold (a rule's held key, or a KMS provider's held key id): the last moment a member
// was seen holding it minus the heldSince it published.
type holdTracker struct {
	mu   sync.Mutex
	max  time.Duration
	stop context.CancelFunc
	done chan struct{}
}

func (b *clusterBed) trackHolds() *holdTracker {
	ctx, cancel := context.WithCancel(b.t.Context())
	h := &holdTracker{stop: cancel, done: make(chan struct{})}
	go func() {
		defer close(h.done)
		for ctx.Err() == nil {
			resp, err := b.cli.Get(ctx, testbed.MembersKey(b.coord, ""), clientv3.WithPrefix())
			now := time.Now()
			if err == nil {
				for _, kv := range resp.Kvs {
					var m struct {
						Resources []struct {
							Held      json.RawMessage `json:"held"`
							HeldSince time.Time       `json:"heldSince"`
						} `json:"resources"`
						KMS []struct {
							Held      string    `json:"heldKeyIDHash"`
							HeldSince time.Time `json:"heldSince"`
						} `json:"kms"`
					}
					if json.Unmarshal(kv.Value, &m) != nil {
						continue
					}
					var since []time.Time
					for _, r := range m.Resources {
						if len(r.Held) > 0 && string(r.Held) != "null" && !r.HeldSince.IsZero() {
							since = append(since, r.HeldSince)
						}
					}
					for _, k := range m.KMS {
						if k.Held != "" && !k.HeldSince.IsZero() {
							since = append(since, k.HeldSince)
						}
					}
					h.mu.Lock()
					for _, s := range since {
						h.max = max(h.max, now.Sub(s))
					}
					h.mu.Unlock()
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return h
}

// Stop ends the polling and returns the longest hold seen.
func (h *holdTracker) Stop() time.Duration {
	h.stop()
	<-h.done
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.max
}

func scenarioOneEdit(t testing.TB, objects int) oneEditResult {
	b := newClusterBed(t, bedConfig{name: "cluster-a", objects: objects, coordination: true})
	holds := b.trackHolds()
	l := b.startLoad()
	edit := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	round := b.syncer.Apply(t.Context(), edit.Render())
	last, err := round.Wait(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	done := b.waitConverged("every object on key2", 60*time.Second, edit.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	converged := done.Sub(last)
	held := holds.Stop()
	t.Logf("%d objects: from the last file update to every object on key2, verified: %v (first file at +%v, last at +%v); longest fence hold %v",
		b.load.Objects(), converged.Round(time.Millisecond), slices.Min(round.Delays).Round(time.Millisecond),
		last.Sub(round.Started).Round(time.Millisecond), held.Round(time.Millisecond))
	b.checkPacedByFollowers("secrets")
	b.dropAndCheck(edit.WithoutKey("key1"))
	_, sr := b.finish(l)
	if err := testbed.AllStoredUnder(t.Context(), b.cli, b.secretsKey, stored2); err != nil {
		t.Fatal(err)
	}
	return oneEditResult{converged: converged, maxHold: held, unreadable: sr.Total().Unreadable}
}

// checkPacedByFollowers fails the test unless resource's latest migration record says
// its pacing judged the clients of more apiservers than the leader: the sampler reads
// through every shim, so each follower's clients have a baseline and reported what
// they saw during the migration (<prefix>/migration/clients/).
func (b *clusterBed) checkPacedByFollowers(resource string) {
	b.t.Helper()
	resp, err := b.cli.Get(b.t.Context(), coordination.MigrationState(strings.TrimSuffix(b.coord, "/")))
	if err != nil || len(resp.Kvs) == 0 {
		b.t.Fatalf("reading the migration state: %v (%d keys)", err, len(resp.Kvs))
	}
	var st struct {
		Leader  string `json:"leader"`
		Records map[string]struct {
			PacedBy []string `json:"pacedByClientsOf"`
		} `json:"records"`
	}
	if err := json.Unmarshal(resp.Kvs[0].Value, &st); err != nil {
		b.t.Fatalf("decoding the migration state: %v", err)
	}
	paced := st.Records[resource].PacedBy
	b.t.Logf("the migration of %s was paced by the clients of %v (leader %s)", resource, paced, st.Leader)
	if len(paced) < 2 || !slices.Contains(paced, st.Leader) {
		b.t.Fatalf("the migration of %s was paced by the clients of %v: want the leader %s's and at least one follower's (every shim serves the sampler)\nstate: %s",
			resource, paced, st.Leader, resp.Kvs[0].Value)
	}
}

// (b) A plugin key-id change: every node's plugin gets the new KEK at its own moment.
// All data moves to the new key id with nothing unreadable, lost or failed.
func TestClusterPluginKeyIDChange(t *testing.T) {
	requireClusterShim(t)
	r := scenarioKeyIDChange(t, clusterObjects(t), "")
	// The plugins get kek-2 at different moments: when they are seconds apart, the
	// first one's shim must have held it back while the others' plugins did not know it.
	if r.spread > 3*time.Second && r.maxHold == 0 {
		t.Errorf("the keyrings were updated %v apart, but no member published a held key id", r.spread)
	}
}

// scenarioKeyIDChange runs (b) with objects Secrets; statusInterval ("" for the bed's
// 1s) is the shims' --kms-status-interval.
func scenarioKeyIDChange(t testing.TB, objects int, statusInterval string) oneEditResult {
	var args []string
	if statusInterval != "" {
		args = []string{"--kms-status-interval", statusInterval}
	}
	b := newClusterBed(t, bedConfig{name: "cluster-b", objects: objects, coordination: true, plugins: true, args: args,
		initial: func(b *clusterBed, i int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.KMSv2(kmsName, b.plugins[i].Endpoint))
		}})
	ctx := t.Context()
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-1")); err != nil {
		t.Fatal(err)
	}
	holds := b.trackHolds()
	l := b.startLoad()
	var keyFiles []string
	for _, p := range b.plugins {
		keyFiles = append(keyFiles, p.KeysFile)
	}
	kek2 := testbed.PluginKey{Name: "kek-2", Secret: testbed.RandomKey()}
	keyrings, err := testbed.NewFileSyncer(testbed.SyncerConfig{Files: keyFiles, MaxDelay: b.cfg.maxDelay,
		Mode: testbed.SyncRename, Seed: clusterSeed(t), Logf: t.Logf})
	if err != nil {
		t.Fatal(err)
	}
	ring := func(keys ...testbed.PluginKey) []byte {
		j, _ := json.Marshal(map[string]any{"keys": keys})
		return j
	}
	round := keyrings.Apply(ctx, ring(kek2, b.kek1))
	last, err := round.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	spread := slices.Max(round.Delays) - slices.Min(round.Delays)
	ctx2, cancel := contextWithTimeout(t, 90*time.Second)
	defer cancel()
	if err := testbed.WaitFor(ctx2, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-2"),
		testbed.StatusProbe(b.shims(), clusterVerdictConverged)); err != nil {
		t.Fatal(err)
	}
	converged := time.Since(last)
	held := holds.Stop()
	t.Logf("%d objects: from the last keyring update to every object on kek-2, verified: %v; longest fence hold %v",
		b.load.Objects(), converged.Round(time.Millisecond), held.Round(time.Millisecond))
	// The old KEK leaves every plugin; everything still reads.
	if _, err := keyrings.Apply(ctx, ring(kek2)).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	time.Sleep(2 * time.Second) // a Status interval and more with writers running
	_, sr := b.finish(l)
	return oneEditResult{converged: converged, maxHold: held, unreadable: sr.Total().Unreadable, spread: spread}
}

// (c) A shim killed mid-promotion (its file still old, the others holding key2
// read-only for it) and restarted later with its old file: the others promote once
// its lease expires, it is not ready while its file cannot read key2, and ready
// once its file catches up.
func TestClusterShimKilledMidPromotion(t *testing.T) {
	requireClusterShim(t)
	b := newClusterBed(t, bedConfig{name: "cluster-c", objects: clusterObjects(t), coordination: true})
	ctx := t.Context()
	l := b.startLoad()
	edit := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	content := edit.Render()
	straggler := b.fleet.Shims[2]
	others := []*testbed.Shim{b.fleet.Shims[0].Current(), b.fleet.Shims[1].Current()}
	if _, err := b.syncer.ApplyEach(ctx, func(int) []byte { return content }, []int{0, 1}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := contextWithTimeout(t, 20*time.Second)
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.ConfigAppliedProbe(others, content, nil)); err != nil {
		t.Fatal(err)
	}
	cancel()
	// The fence holds while the straggler is alive and cannot read key2.
	time.Sleep(time.Second)
	if got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey); err != nil || got[stored2] != 0 {
		t.Fatalf("written with key2 while %s cannot read it: %v (%v)", straggler.ID, got, err)
	}
	straggler.Kill()
	b.waitConverged("every object on key2 without the killed shim", 60*time.Second, content,
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))

	// Back with its old file: not ready, and it stays so.
	if err := straggler.Launch(ctx); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline); time.Sleep(250 * time.Millisecond) {
		if err := straggler.Current().Readyz(ctx); err == nil {
			doc, _ := straggler.Current().Status(ctx)
			t.Fatalf("%s is ready with a file that cannot read key2; its status document:\n%s", straggler.ID, doc.Raw)
		}
	}
	// The others keep writing with key2 (a promoted key is not demoted for a
	// straggler): nothing new under key1 while it is back with its old file.
	if got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey); err != nil || got[stored1] != 0 {
		t.Fatalf("written with key1 after %s rejoined with its old file: %v (%v)", straggler.ID, got, err)
	}
	// Its file catches up: ready, back in rotation.
	if _, err := b.syncer.ApplyEach(ctx, func(int) []byte { return content }, []int{2}).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := straggler.WaitReady(rctx); err != nil {
		t.Fatal(err)
	}
	b.waitConverged("converged with the straggler back", 30*time.Second, content,
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	b.dropAndCheck(edit.WithoutKey("key1"))
	wr, _ := b.finish(l)
	t.Logf("writes to %s while it was out: %d excused", straggler.ID, wr.PerEndpoint[straggler.ID].Excused)
}

// (d) The migration leader killed mid-migration: another shim takes over and
// resumes from the checkpoint; nothing is lost.
func TestClusterLeaderKilledMidMigration(t *testing.T) {
	requireClusterShim(t)
	n := clusterObjects(t)
	// A bounded rate keeps the migration running long enough to kill its leader.
	// CLUSTER_SHIMS sets the number of apiservers (the many-apiservers failover figure).
	b := newClusterBed(t, bedConfig{name: "cluster-d", objects: n, coordination: true, shims: envInt("CLUSTER_SHIMS", 3),
		args: []string{"--storage-migration-rate", strconv.Itoa(max(n/8, 50))}})
	ctx := t.Context()
	l := b.startLoad()
	edit := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	if _, err := b.syncer.Apply(ctx, edit.Render()).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	wctx, stopCounting := context.WithCancel(ctx)
	defer stopCounting()
	inPlace := countRewritesInPlace(wctx, t, b.cli, b.secretsKey, stored2, b.key2)
	b.midMigration(stored1, stored2, 60*time.Second)
	leader, err := testbed.MigrationLeader(ctx, b.cli, b.coord)
	if err != nil {
		t.Fatalf("no migration leader under %s: %v", testbed.MigrationLeaderKey(b.coord), err)
	}
	i := slices.Index(b.ids(), leader)
	if i < 0 {
		t.Fatalf("the migration leader is %q, not one of %v", leader, b.ids())
	}
	killed := b.fleet.Shims[i]
	killed.Kill()
	killedAt := time.Now()
	t.Logf("killed the migration leader %s", leader)
	// Another shim is elected once the dead one's lease expires.
	ectx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	err = testbed.WaitFor(ectx, 200*time.Millisecond, testbed.Probe{Name: "new migration leader", Check: func(ctx context.Context) error {
		next, err := testbed.MigrationLeader(ctx, b.cli, b.coord)
		if err != nil {
			return err
		}
		if next == leader || !slices.Contains(b.ids(), next) {
			return fmt.Errorf("leader %q", next)
		}
		return nil
	}})
	if err != nil {
		t.Fatal(err)
	}
	elected := time.Since(killedAt)
	verified := b.waitConverged("every object on key2 after the leader died", 90*time.Second, edit.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2))
	// The failover figures: a new leader once the dead one's lease expires, the
	// migration resumed from the checkpoint, and the objects rewritten a second time
	// (those the dead leader moved after its last checkpoint).
	t.Logf("failover with %d apiservers: new leader %v after the kill, verified %v after it; %d of %d objects rewritten twice",
		len(b.fleet.Shims), elected.Round(time.Millisecond), verified.Sub(killedAt).Round(time.Millisecond), inPlace(), n)
	if err := killed.Launch(ctx); err != nil {
		t.Fatal(err)
	}
	rctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := killed.WaitReady(rctx); err != nil {
		t.Fatal(err)
	}
	b.dropAndCheck(edit.WithoutKey("key1"))
	b.finish(l)
}

// (e) One etcd member of three goes down during a rotation, as in an upgrade or a
// reboot: every shim has all three endpoints. After two rotations with every member up
// (the second is the baseline), one loses the etcd leader once the new key writes, the
// next a follower; each finishes through the outage with the clients served, and the old key
// is dropped while the member is down. Each rotation's migrate stage (the first object
// under the new key to the last one under the old, as etcd shows it) is logged, beside
// the baseline's with E2E_LONG=1 (make e2e-long): the baseline rotation only measures,
// and took 30 s of the default run.
func TestClusterOneEtcdMemberDown(t *testing.T) {
	requireClusterShim(t)
	b := newClusterBed(t, bedConfig{name: "cluster-e", objects: clusterObjects(t), coordination: true, etcdLeaderLoss: true, args: []string{"--v=2"}})
	l := b.startLoad()
	ctx := t.Context()
	// The first rotation is the cluster's first migration: it starts at the pacer's
	// start rate and finds the clients' level. Every later one starts from the rate
	// that one sustained (the migration records keep it), so the baseline to compare
	// a member outage with is the second, with every member up too.
	steps := []struct {
		down     string // which member goes down: "", "leader" or "follower"
		cfg      testbed.EncryptionConfig
		drop     string
		from, to string
	}{
		{"", testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1)), "key1", stored1, stored2},
		{"", testbed.SecretsConfig(testbed.AESGCM(b.key3, b.key2)), "key2", stored2, stored3},
		{"leader", testbed.SecretsConfig(testbed.AESGCM(b.key1, b.key3)), "key3", stored3, stored1},
		{"follower", testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1)), "key1", stored1, stored2},
	}
	if !e2eLong() {
		// Without the baseline: key1 → key2 (every member up), then key2 → key1 with
		// the leader down and key1 → key2 with a follower down.
		steps = []struct {
			down     string
			cfg      testbed.EncryptionConfig
			drop     string
			from, to string
		}{
			steps[0],
			{"leader", testbed.SecretsConfig(testbed.AESGCM(b.key1, b.key2)), "key2", stored2, stored1},
			steps[3],
		}
	}
	var baseline migrateStage
	for i, st := range steps {
		stage := b.watchMigrateStage(st.from, st.to)
		applied := time.Now()
		if _, err := b.syncer.Apply(ctx, st.cfg.Render()).Wait(ctx); err != nil {
			t.Fatal(err)
		}
		var m *testbed.EtcdMember
		if st.down != "" {
			// Killed (not stopped: a graceful stop of the leader hands leadership over
			// first and takes seconds) once the new key writes, before the migration
			// has got far.
			b.storedUnder(st.to, 60*time.Second)
			m = b.etcdMember(st.down)
			m.Kill()
			t.Logf("%s (the etcd %s) killed %v after the edit", m.Name, st.down, time.Since(applied).Round(time.Millisecond))
		}
		verified := b.waitConverged(fmt.Sprintf("every object under %s (etcd member down: %q)", st.to, st.down), 60*time.Second,
			st.cfg.Render(), testbed.StoredUnderProbe(b.cli, b.secretsKey, st.to))
		took := stage()
		if st.down == "" {
			what := "the cluster's first migration"
			if i > 0 {
				what, baseline = "the baseline", took
			}
			t.Logf("rotation with every etcd member up (%s): edit → verified %v, migrate stage %v", what, verified.Sub(applied).Round(time.Millisecond), took)
		} else if baseline.took == 0 {
			t.Logf("rotation with the etcd %s down: edit → verified %v, migrate stage %v (no baseline without E2E_LONG=1)", st.down,
				verified.Sub(applied).Round(time.Millisecond), took)
		} else {
			t.Logf("rotation with the etcd %s down: edit → verified %v, migrate stage %v: ×%.2f the baseline's %v, ×%.2f per stale object", st.down,
				verified.Sub(applied).Round(time.Millisecond), took, took.took.Seconds()/max(baseline.took.Seconds(), 0.001), baseline.took.Round(time.Millisecond),
				took.perObject().Seconds()/max(baseline.perObject().Seconds(), 1e-9))
		}
		b.dropAndCheck(st.cfg.WithoutKey(st.drop))
		if m == nil {
			continue
		}
		if err := m.Restart(); err != nil {
			t.Fatal(err)
		}
		rctx, cancel := contextWithTimeout(t, 60*time.Second)
		if err := b.etcd.WaitHealthy(rctx); err != nil {
			t.Fatal(err)
		}
		if err := b.etcd.WaitCaughtUp(rctx, m); err != nil {
			t.Fatal(err)
		}
		cancel()
	}
	b.finish(l)
}

// migrateStage is one measured migrate stage: from the first Secret stored under the
// new key until none is left under the old one (took 0 when that was not seen), and
// how many were still under the old key at its start. The writers rewrite some of them
// meanwhile, and more the later the migration starts, so the time per stale object
// compares stages better than the time alone.
type migrateStage struct {
	took  time.Duration
	stale int
}

func (m migrateStage) perObject() time.Duration {
	return m.took / time.Duration(max(m.stale, 1))
}

func (m migrateStage) String() string {
	return fmt.Sprintf("%v for %d stale objects (%v each)", m.took.Round(time.Millisecond), m.stale, m.perObject().Round(time.Microsecond))
}

// watchMigrateStage polls etcd from now on and returns a function that stops and
// returns the migrate stage from from to to.
func (b *clusterBed) watchMigrateStage(from, to string) func() migrateStage {
	ctx, cancel := context.WithCancel(b.t.Context())
	done := make(chan migrateStage, 1)
	go func() {
		var first time.Time
		var stale int
		for {
			if got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey); err == nil {
				if first.IsZero() && got[to] > 0 {
					first, stale = time.Now(), got[from]
				}
				if !first.IsZero() && got[from] == 0 {
					done <- migrateStage{took: time.Since(first), stale: stale}
					return
				}
			}
			select {
			case <-ctx.Done():
				done <- migrateStage{}
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	}()
	return func() migrateStage {
		defer cancel()
		select {
		case d := <-done:
			return d
		case <-time.After(5 * time.Second):
			return migrateStage{}
		}
	}
}

// etcdMember is the etcd member that leads now ("leader") or one that does not.
func (b *clusterBed) etcdMember(which string) *testbed.EtcdMember {
	b.t.Helper()
	leader, err := b.etcd.Leader(b.t.Context())
	if err != nil {
		b.t.Fatal(err)
	}
	if which == "leader" {
		return leader
	}
	for _, m := range b.etcd.Members {
		if m != leader && m.Running() {
			return m
		}
	}
	b.t.Fatal("no running follower")
	return nil
}

// storedUnder waits until etcd holds a Secret under prefix: the new key writes.
func (b *clusterBed) storedUnder(prefix string, timeout time.Duration) {
	t := b.t
	t.Helper()
	ctx, cancel := contextWithTimeout(t, timeout)
	defer cancel()
	err := testbed.WaitFor(ctx, 50*time.Millisecond, testbed.Probe{Name: "stored under " + prefix, Check: func(ctx context.Context) error {
		got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey)
		if err != nil {
			return err
		}
		if got[prefix] > 0 {
			return nil
		}
		return fmt.Errorf("stored %v", got)
	}})
	if err != nil {
		t.Fatalf("waiting for a Secret under %s: %v", prefix, err)
	}
}

// (f) The key changes again (key3) while the migration to key2 runs: key3 is
// migrated next and nothing stays behind on key2 or key1.
func TestClusterKeyChangesDuringMigration(t *testing.T) {
	requireClusterShim(t)
	n := clusterObjects(t)
	b := newClusterBed(t, bedConfig{name: "cluster-f", objects: n, coordination: true,
		args: []string{"--storage-migration-rate", strconv.Itoa(max(n/8, 50))}})
	ctx := t.Context()
	l := b.startLoad()
	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	if _, err := b.syncer.Apply(ctx, to2.Render()).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	b.midMigration(stored1, stored2, 60*time.Second)
	to3 := testbed.SecretsConfig(testbed.AESGCM(b.key3, b.key2, b.key1))
	if _, err := b.syncer.Apply(ctx, to3.Render()).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	// The budget bounds a stall: the migration goes at its clients' pace, and on a
	// machine running other test groups that was once a floor of 10 objects/s until the
	// pacer re-measured its clients' baseline there (pkg/migrate/pace).
	b.waitConverged("every object on key3", 150*time.Second, to3.Render(),
		testbed.StoredUnderProbe(b.cli, b.secretsKey, stored3))
	b.dropAndCheck(to3.WithoutKey("key1").WithoutKey("key2"))
	b.finish(l)
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, stored3); err != nil {
		t.Fatal(err)
	}
}

func contextWithTimeout(t testing.TB, d time.Duration) (context.Context, context.CancelFunc) {
	return context.WithTimeout(t.Context(), d)
}

// (g) An apiserver paused (SIGSTOP) for longer than its member lease comes back after
// the others rotated to key2 and dropped key1, the key its own file still writes with:
// it writes nothing with key1. A create sent to it while it was stopped is answered the
// moment it runs again, before any of its goroutines noticed the pause; that one and
// every later write are refused (the write gate, then the fence), and nothing is
// stored under key1.
func TestClusterPausedMemberWritesNothingWithADroppedKey(t *testing.T) {
	requireClusterShim(t)
	b := newClusterBed(t, bedConfig{name: "cluster-g", objects: 200, coordination: true})
	ctx := t.Context()
	paused := b.fleet.Shims[2].Current()
	if err := paused.Pause(); err != nil {
		t.Fatal(err)
	}
	resumed := false
	t.Cleanup(func() {
		if !resumed {
			_ = paused.Resume()
		}
	})
	wait := func(what string, timeout time.Duration, probes ...testbed.Probe) {
		t.Helper()
		wctx, cancel := contextWithTimeout(t, timeout)
		defer cancel()
		if err := testbed.WaitFor(wctx, 100*time.Millisecond, probes...); err != nil {
			t.Fatalf("%s: %v", what, err)
		}
	}
	// Its lease (3 s) ends; the others rotate without it and drop key1.
	wait("the paused apiserver's record gone", 30*time.Second,
		testbed.MembersProbe(b.cli, b.coord, b.idsOf(0, 1), func(string, json.RawMessage) error { return nil }))
	to2 := testbed.SecretsConfig(testbed.AESGCM(b.key2, b.key1))
	b.applyTo(to2.Render(), 0, 1)
	wait("every Secret under key2", 60*time.Second, testbed.StoredUnderProbe(b.cli, b.secretsKey, stored2),
		testbed.ConfigAppliedProbe(shimsOf(b.fleet, 0, 1), to2.Render(), nil))
	only2 := to2.WithoutKey("key1")
	b.applyTo(only2.Render(), 0, 1)
	wait("key1 dropped by the others", 60*time.Second, testbed.ConfigAppliedProbe(shimsOf(b.fleet, 0, 1), only2.Render(), nil))

	// Creates through the paused apiserver: the first waits in its socket's backlog.
	client, err := kubernetes.NewForConfig(paused.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	var created, refused atomic.Int64
	var firstErr atomic.Value
	wctx, stopWriting := context.WithCancel(ctx)
	writing := make(chan struct{})
	go func() {
		defer close(writing)
		for i := 0; wctx.Err() == nil; i++ {
			rctx, cancel := context.WithTimeout(wctx, 10*time.Second)
			_, err := client.CoreV1().Secrets(b.load.Namespace).Create(rctx, &corev1.Secret{
				ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("after-pause-%d", i)},
				Data:       map[string][]byte{"v": []byte("x")}}, metav1.CreateOptions{})
			cancel()
			if err == nil {
				created.Add(1)
			} else if wctx.Err() == nil {
				refused.Add(1)
				firstErr.CompareAndSwap(nil, err.Error())
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	time.Sleep(300 * time.Millisecond) // the first create is in flight
	if err := paused.Resume(); err != nil {
		t.Fatal(err)
	}
	resumed = true
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		got, err := testbed.StoredPrefixes(ctx, b.cli, b.secretsKey)
		if err == nil && got[stored1] > 0 {
			stopWriting()
			t.Fatalf("%d Secrets stored under key1, which every other apiserver dropped", got[stored1])
		}
		time.Sleep(50 * time.Millisecond)
	}
	stopWriting()
	<-writing
	t.Logf("through the resumed apiserver: %d creates refused (first: %v), %d created", refused.Load(), firstErr.Load(), created.Load())
	if created.Load() > 0 {
		t.Errorf("%d creates succeeded through an apiserver that can only write with the dropped key1", created.Load())
	}
	if refused.Load() == 0 {
		t.Error("no create was refused: the writer never reached the resumed apiserver")
	}
	if !strings.Contains(paused.Log(1<<20), "Holding every write until this apiserver is back in the cluster's view") {
		t.Error("the resumed apiserver never logged that it held its writes after the pause")
	}
}
