package migrate

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/testutil"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestMigrationPausesBeforeTheQuotaAndResumesAfterCompaction fills an etcd with a
// 32 MiB quota with stale objects whose rewrite alone would take it past the 75% mark:
// the migration pauses before it (no NOSPACE, the database under the limit), says so
// in its progress, its metric and its log, and goes on only after the test — standing
// in for kube-apiserver and the operator — compacts and defragments.
func TestMigrationPausesBeforeTheQuotaAndResumesAfterCompaction(t *testing.T) {
	const quota = 32 << 20
	const fraction = 0.75
	ctx := context.Background()
	srv := etcdtest.StartWith(t, etcdtest.Options{QuotaBackendBytes: quota})
	cli := srv.Client(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")

	// 1400 objects of about 9 KiB: 12 MiB now, as much again once all are rewritten.
	const objects = 1400
	pad := strings.Repeat("p", 9<<10)
	for i := range objects {
		key := keyOf(secrets, "fill", fmt.Sprintf("s%05d", i))
		writeAt(t, cli, old, key, enctest.StoredObject(fmt.Sprintf("{key=%s pad=%s}", key, pad)))
	}
	before := dbStatus(t, cli, srv.Endpoint)
	t.Logf("before: db size %s, in use %s", mib(before.DbSize), mib(before.DbSizeInUse))

	reg := metrics.NewKubeRegistry()
	mets, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	paused := make(chan pace.PauseState, 16)
	var mu sync.Mutex
	var last pace.PauseState
	opts := Options{
		Client: cli, Source: FromSet(next), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)},
		Space:   pace.SpaceOptions{QuotaBytes: quota, MaxFraction: fraction, CheckInterval: 100 * time.Millisecond},
		Metrics: mets, Logger: testLogger(t),
		Progress: func(p Progress) {
			mu.Lock()
			defer mu.Unlock()
			if p.Paused.Reason != last.Reason && p.Paused.Reason != "" {
				paused <- p.Paused
			}
			last = p.Paused
		},
	}
	type outcome struct {
		res *Result
		err error
	}
	done := make(chan outcome, 1)
	go func() {
		res, err := Migrate(ctx, opts)
		done <- outcome{res, err}
	}()

	pauses := 0
	// defragmented: the test has defragmented etcd, which holds every request to the
	// member meanwhile; under load (four test groups on two cores) the migration's
	// read of the database size then timed out, and it paused for that, rightly.
	defragmented := false
	for {
		select {
		case p := <-paused:
			if p.Reason == pace.PauseUnknown && defragmented {
				t.Logf("paused while the test's defragmentation held etcd: %s", p.Condition)
				continue
			}
			pauses++
			if p.Reason != pace.PauseDBSize {
				t.Fatalf("paused for %q (%s), want %q", p.Reason, p.Condition, pace.PauseDBSize)
			}
			st := dbStatus(t, cli, srv.Endpoint)
			t.Logf("pause %d: %s; db size %s, in use %s", pauses, p.Condition, mib(st.DbSize), mib(st.DbSizeInUse))
			if st.DbSizeInUse > int64(fraction*quota) || st.DbSize >= quota {
				t.Errorf("paused too late: db size %d, in use %d (limit %d, quota %d)", st.DbSize, st.DbSizeInUse, int64(fraction*quota), quota)
			}
			noAlarm(t, cli)
			if v, err := testutil.GetGaugeMetricValue(mets.paused.WithLabelValues(pace.PauseDBSize)); err != nil || v != 1 {
				t.Errorf("rekey_storage_migration_paused{reason=%q} = %v (%v) while paused, want 1", pace.PauseDBSize, v, err)
			}
			// A paused migration writes nothing: the revision stays (once the
			// transactions admitted before the pause have landed).
			time.Sleep(200 * time.Millisecond)
			rev := currentRev(t, cli)
			time.Sleep(300 * time.Millisecond)
			if now := currentRev(t, cli); now != rev {
				t.Errorf("the revision moved from %d to %d while the migration was paused", rev, now)
			}
			// kube-apiserver compacts, the operator defragments.
			if err := srv.Compact(ctx, cli, currentRev(t, cli)); err != nil {
				t.Fatal(err)
			}
			defragmented = true
			if _, err := cli.Defragment(ctx, srv.Endpoint); err != nil {
				t.Fatal(err)
			}
		case out := <-done:
			if out.err != nil {
				t.Fatalf("migration: %v", out.err)
			}
			if pauses == 0 {
				t.Fatal("the migration never paused, yet rewriting everything would have passed the limit")
			}
			if out.res.Rewritten != objects {
				t.Errorf("rewritten %d, want %d", out.res.Rewritten, objects)
			}
			noAlarm(t, cli)
			if v, _ := testutil.GetGaugeMetricValue(mets.paused.WithLabelValues(pace.PauseDBSize)); v != 0 {
				t.Errorf("rekey_storage_migration_paused{reason=%q} = %v after the migration resumed, want 0", pace.PauseDBSize, v)
			}
			return
		case <-time.After(2 * time.Minute):
			t.Fatal("the migration neither paused nor finished within 2 minutes")
		}
	}
}

func dbStatus(t *testing.T, cli *clientv3.Client, ep string) *clientv3.StatusResponse {
	t.Helper()
	st, err := cli.Status(context.Background(), ep)
	if err != nil {
		t.Fatal(err)
	}
	return st
}

func noAlarm(t *testing.T, cli *clientv3.Client) {
	t.Helper()
	alarms, err := cli.AlarmList(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range alarms.Alarms {
		if a.Alarm == etcdserverpb.AlarmType_NOSPACE {
			t.Fatal("etcd raised NOSPACE")
		}
	}
}

// TestMigrationObeysThePacersRate slows every transaction of the migration down far
// past the latency target: the pacer cuts the rate to its floor, and from then on the
// migration writes no faster than that.
func TestMigrationObeysThePacersRate(t *testing.T) {
	const (
		objects = 160
		batch   = 4
		floor   = 40.0
	)
	ctx := context.Background()
	cli, next, slow := staleSecretsBehindSlowKV(t, objects, 20*time.Millisecond)

	var mu sync.Mutex
	var floorAt time.Time
	res, err := Migrate(ctx, Options{
		Client: cli, Source: FromSet(next), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)},
		Rate: 1000, BatchSize: batch, Workers: 1, PageSize: 20, Logger: testLogger(t),
		Pacing: pace.Options{TargetLatency: 5 * time.Millisecond, Window: 100 * time.Millisecond, MinRate: floor},
		Progress: func(p Progress) {
			mu.Lock()
			defer mu.Unlock()
			if p.AllowedRate == floor && floorAt.IsZero() {
				floorAt = time.Now()
			}
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != objects {
		t.Fatalf("rewritten %d, want %d", res.Rewritten, objects)
	}
	if floorAt.IsZero() {
		t.Fatalf("the allowed rate never reached the floor %v/s with every transaction 4× over the target", floor)
	}
	// Objects committed after the rate reached the floor, over the time they took: at
	// most the floor, plus one batch of burst.
	commits := slow.commitsAfter(floorAt)
	if len(commits) < 2 {
		t.Fatalf("only %d transactions after the rate reached its floor", len(commits))
	}
	var n int
	for _, c := range commits {
		n += c.objects
	}
	span := commits[len(commits)-1].at.Sub(floorAt).Seconds()
	if limit := floor*span + 2*batch; float64(n) > limit {
		t.Errorf("%d objects in %.2fs after the rate reached %v/s (at most %.0f allowed)", n, span, floor, limit)
	}
	t.Logf("%d objects in %.2fs after the floor; whole migration %s", n, span, res.Duration)
}

// staleSecretsBehindSlowKV stores objects Secrets under key1 and returns a client
// whose transactions go through a slowKV adding delay, and the set that writes key2.
func staleSecretsBehindSlowKV(t *testing.T, objects int, delay time.Duration) (*clientv3.Client, *transformers.Set, *slowKV) {
	t.Helper()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	writeObjects(t, cli, old, secrets, objects)
	kv := &slowKV{KV: cli.KV, delay: delay}
	cli.KV = kv
	return cli, next, kv
}

// slowKV adds a delay to every transaction's commit and records when each ended.
type slowKV struct {
	clientv3.KV
	delay time.Duration

	mu      sync.Mutex
	commits []commitRecord
}

type commitRecord struct {
	at      time.Time
	objects int
}

func (s *slowKV) Txn(ctx context.Context) clientv3.Txn { return &slowTxn{Txn: s.KV.Txn(ctx), kv: s} }

// committedSince says whether a transaction ended after t.
func (s *slowKV) committedSince(t time.Time) bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	return len(s.commits) > 0 && s.commits[len(s.commits)-1].at.After(t)
}

func (s *slowKV) commitsAfter(t time.Time) []commitRecord {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []commitRecord
	for _, c := range s.commits {
		if c.at.After(t) {
			out = append(out, c)
		}
	}
	return out
}

type slowTxn struct {
	clientv3.Txn
	kv   *slowKV
	puts int
}

func (t *slowTxn) If(cs ...clientv3.Cmp) clientv3.Txn { t.Txn = t.Txn.If(cs...); return t }
func (t *slowTxn) Else(ops ...clientv3.Op) clientv3.Txn {
	t.Txn = t.Txn.Else(ops...)
	return t
}
func (t *slowTxn) Then(ops ...clientv3.Op) clientv3.Txn {
	t.Txn, t.puts = t.Txn.Then(ops...), len(ops)
	return t
}

func (t *slowTxn) Commit() (*clientv3.TxnResponse, error) {
	time.Sleep(t.kv.delay)
	resp, err := t.Txn.Commit()
	t.kv.mu.Lock()
	t.kv.commits = append(t.kv.commits, commitRecord{at: time.Now(), objects: t.puts})
	t.kv.mu.Unlock()
	return resp, err
}

// TestMigrationSlowsDownForSlowClients: etcd stays fast, but the apiserver's clients
// are answered 20 times slower than before the migration while it writes or re-scans
// (a control plane whose CPUs the rewrite takes). The migration starts at the serving
// start rate rather than at full speed, falls to its floor, pauses there to measure
// the clients without it (fast: it is what slows them, so it keeps its floor), spends
// the floor 50 ms of it per transaction, and once it is over the clients' requests
// make the baseline again.
func TestMigrationSlowsDownForSlowClients(t *testing.T) {
	const (
		// readCost is pace's: a re-scan reads this many objects per one written.
		readCost = 2
		objects  = 120
		floor    = 40.0
	)
	ctx := context.Background()
	cli, next, kv := staleSecretsBehindSlowKV(t, objects, 0)

	serving := pace.NewServingLatency(nil)
	// Twice the samples a baseline needs (pace's minServingBaselineSamples).
	for range 100 {
		serving.Observe(pace.RequestRead, 2*time.Millisecond)
	}
	stop := make(chan struct{})
	clientsDone := make(chan struct{})
	var verifying atomic.Bool
	go func() {
		defer close(clientsDone)
		for {
			select {
			case <-stop:
				return
			case <-time.After(2 * time.Millisecond):
				// Slow while the migration writes (a transaction in the last 100ms:
				// at the floor one ends every 50ms) or re-scans.
				if verifying.Load() || kv.committedSince(time.Now().Add(-100*time.Millisecond)) {
					serving.Observe(pace.RequestRead, 40*time.Millisecond)
				} else {
					serving.Observe(pace.RequestRead, 2*time.Millisecond)
				}
			}
		}
	}()

	var mu sync.Mutex
	var rates []float64
	var floorAt, verifyAt time.Time
	var slowedBy []string
	res, err := Migrate(ctx, Options{
		Client: cli, Source: FromSet(next), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)},
		Workers: 1, PageSize: 20, Logger: testLogger(t),
		Pacing: pace.Options{Window: 100 * time.Millisecond, MinRate: floor, Serving: serving},
		Progress: func(p Progress) {
			mu.Lock()
			defer mu.Unlock()
			if len(rates) == 0 || rates[len(rates)-1] != p.AllowedRate {
				rates = append(rates, p.AllowedRate)
			}
			if p.AllowedRate == floor && floorAt.IsZero() {
				floorAt = time.Now()
			}
			if p.SlowedBy != "" && !slices.Contains(slowedBy, p.SlowedBy) {
				slowedBy = append(slowedBy, p.SlowedBy)
			}
			if p.Phase == "verify" && verifyAt.IsZero() {
				verifyAt = time.Now()
				verifying.Store(true)
			}
		},
	})
	verifyTook := time.Since(verifyAt)
	close(stop)
	<-clientsDone
	if err != nil {
		t.Fatal(err)
	}
	if res.Rewritten != objects {
		t.Fatalf("rewritten %d, want %d", res.Rewritten, objects)
	}
	t.Logf("allowed rates: %v", rates)
	if rates[0] != pace.DefaultServingStartRate {
		t.Errorf("the migration started at %v/s; with a serving baseline it starts at %v/s", rates[0], float64(pace.DefaultServingStartRate))
	}
	if floorAt.IsZero() {
		t.Fatalf("the allowed rate never reached the floor %v/s with the clients 20× slower than their baseline", floor)
	}
	if res.AllowedRate != floor {
		t.Errorf("the result says the migration ended at %v/s, want the floor %v/s it was held at (the next resource resumes from it)", res.AllowedRate, floor)
	}
	// The verifying re-scan is paced too: it resumes at readCost × the floor, and the
	// clients stay slow, so it reads at most that; its first page (20) is free.
	if least := time.Duration(float64(objects-20) / (readCost * floor) * float64(time.Second)); verifyTook < least*9/10 {
		t.Errorf("the verifying re-scan of %d objects took %v; at most %v/s with the clients slow, it takes at least %v", objects, verifyTook, readCost*floor, least)
	}
	// The clients must be named; etcd may be too (on a loaded machine its latency passes
	// the target as well, and the last window's cause is then etcd's).
	if !slices.ContainsFunc(slowedBy, func(s string) bool { return strings.Contains(s, "clients answered slower") }) {
		t.Errorf("progress says the migration was slowed by %q, want the apiserver's clients among the causes", slowedBy)
	}
	for _, c := range kv.commitsAfter(floorAt.Add(100 * time.Millisecond)) {
		if c.objects > 2 {
			t.Errorf("a transaction of %d objects at %v/s: the floor is spent 50ms (2 objects) at a time", c.objects, floor)
		}
	}
	// The next migration finds the baseline again (pace's TestServingLatencyBaseline
	// shows the requests answered while migrating stay out of it).
	after := pace.NewWriter(pace.WriterOptions{Client: cli, Clock: clock.RealClock{}, Logger: testLogger(t), MaxBatch: 1, Pacing: pace.Options{Serving: serving}})
	defer after.Close()
	if _, r, _ := after.State(); r != pace.DefaultServingStartRate {
		t.Errorf("a migration after this one starts at %v/s, want %v/s: the baseline is gone", r, float64(pace.DefaultServingStartRate))
	}
}

// mib formats a database size for the test logs.
func mib(n int64) string { return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20)) }
