package pace

import (
	"context"
	"errors"
	"fmt"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/freeport"
)

// scriptedTxn fails Commit with the errors left in errs, one per attempt, then
// succeeds; it records each attempt's context.
type scriptedTxn struct {
	errs     *[]error
	attempts *[]context.Context
	ctx      context.Context
}

func (s scriptedTxn) If(...clientv3.Cmp) clientv3.Txn  { return s }
func (s scriptedTxn) Then(...clientv3.Op) clientv3.Txn { return s }
func (s scriptedTxn) Else(...clientv3.Op) clientv3.Txn { return s }
func (s scriptedTxn) Commit() (*clientv3.TxnResponse, error) {
	*s.attempts = append(*s.attempts, s.ctx)
	if len(*s.errs) > 0 {
		err := (*s.errs)[0]
		*s.errs = (*s.errs)[1:]
		return nil, err
	}
	return &clientv3.TxnResponse{Succeeded: true}, nil
}

// While etcd elects a new leader or loses the member a transaction went to, the
// transaction is tried again, each attempt under its own deadline, and the failures do
// not slow the migration down as congestion would. A migration failed on the first
// such error before, started over and crawled (a killed etcd leader made its migrate
// stage ×3).
func TestTxnTriesAgainWhileEtcdIsUnavailable(t *testing.T) {
	cli := etcdtest.Start(t).Client(t)
	g := NewWriter(WriterOptions{Client: cli, Clock: clock.RealClock{}, MaxBatch: 8, Logger: ktesting.NewLogger(t, ktesting.NewConfig())})
	rateBefore := g.pacer.Rate()
	errs := []error{rpctypes.ErrTimeoutDueToLeaderFail, rpctypes.ErrLeaderChanged, context.DeadlineExceeded}
	var attempts []context.Context
	resp, err := g.Txn(t.Context(), 1, 100, func(ctx context.Context) clientv3.Txn {
		return scriptedTxn{errs: &errs, attempts: &attempts, ctx: ctx}
	})
	if err != nil || resp == nil || !resp.Succeeded {
		t.Fatalf("txn = %v, %v; want it to succeed on the fourth attempt", resp, err)
	}
	if len(attempts) != 4 {
		t.Fatalf("%d attempts, want 4", len(attempts))
	}
	for i, ctx := range attempts {
		if dl, ok := ctx.Deadline(); !ok || dl.IsZero() {
			t.Errorf("attempt %d had no deadline of its own", i)
		}
	}
	if g.pacer.errors != 0 || g.pacer.Rate() < rateBefore {
		t.Errorf("unavailability counted as congestion: %d errors, rate %v → %v", g.pacer.errors, rateBefore, g.pacer.Rate())
	}

	// A refusal is not unavailability: it is returned at once.
	refused := errors.New("etcdserver: permission denied")
	errs, attempts = []error{refused}, nil
	if _, err := g.Txn(t.Context(), 1, 100, func(ctx context.Context) clientv3.Txn {
		return scriptedTxn{errs: &errs, attempts: &attempts, ctx: ctx}
	}); !errors.Is(err, refused) || len(attempts) != 1 {
		t.Errorf("txn with a refusal = %v after %d attempts; want it returned after 1", err, len(attempts))
	}
}

// The clients' requests answered while etcd could not answer the migration waited for
// etcd as the migration did (up to etcd's 7 s request timeout in an election): they
// are not judged as the migration's doing. Before, one such window halved the rate
// of a migration whose etcd leader was killed. Those waiting in the pacer for enough
// others to be judged are dropped with them: they held the rate for windows.
func TestClientsWaitingOutAnEtcdOutageAreNotJudged(t *testing.T) {
	cli := etcdtest.Start(t).Client(t)
	serving := NewServingLatency(clock.RealClock{})
	for range minServingBaselineSamples {
		serving.Observe(RequestRead, 5*time.Millisecond)
	}
	g := NewWriter(WriterOptions{Client: cli, Clock: clock.RealClock{}, MaxBatch: 8,
		Pacing: Options{Serving: serving, Window: time.Hour}, Logger: ktesting.NewLogger(t, ktesting.NewConfig())})
	defer g.Close()
	// A few answered before the outage, too few to judge yet: they wait in the pacer.
	// (Requests are judged when they arrived after the migration began.)
	time.Sleep(10 * time.Millisecond)
	serving.Observe(RequestRead, 6*time.Millisecond)
	if _, err := g.Txn(t.Context(), 1, 100, func(ctx context.Context) clientv3.Txn {
		return scriptedTxn{errs: new([]error), attempts: new([]context.Context), ctx: ctx}
	}); err != nil {
		t.Fatal(err)
	}
	if n := g.pacer.pendingServing(); n != 1 {
		t.Fatalf("%d client requests wait in the pacer before the outage, want 1", n)
	}
	errs := []error{rpctypes.ErrTimeoutDueToLeaderFail, rpctypes.ErrNoLeader}
	var attempts []context.Context
	if _, err := g.Txn(t.Context(), 1, 100, func(ctx context.Context) clientv3.Txn {
		// Clients answered while etcd elects a leader, before and as it returns.
		for range 10 {
			serving.Observe(RequestRead, 5*time.Millisecond)
		}
		return scriptedTxn{errs: &errs, attempts: &attempts, ctx: ctx}
	}); err != nil {
		t.Fatal(err)
	}
	if n := g.pacer.pendingServing(); n != 0 {
		t.Fatalf("%d client requests of the etcd outage or waiting from before it are in the pacer, want none (those waiting would hold the rate for windows)", n)
	}
	// Once a window has passed, the clients are judged again.
	g.mu.Lock()
	g.excuseServingUntil = time.Now()
	g.mu.Unlock()
	serving.Observe(RequestRead, 8*time.Millisecond)
	if _, err := g.Txn(t.Context(), 1, 100, func(ctx context.Context) clientv3.Txn {
		return scriptedTxn{errs: new([]error), attempts: &attempts, ctx: ctx}
	}); err != nil {
		t.Fatal(err)
	}
	if n := g.pacer.pendingServing(); n != 1 {
		t.Fatalf("%d client requests handed to the pacer after the outage, want 1", n)
	}
}

// An attempt is bounded by 20 × the latency target, within 1–3 s: given up soon after
// a lost leader's election, while a slow etcd keeps its time.
func TestAttemptTimeoutFollowsTheLatencyTarget(t *testing.T) {
	for _, c := range []struct{ target, want time.Duration }{
		{0, 3 * time.Second},
		{20 * time.Millisecond, time.Second},
		{100 * time.Millisecond, 2 * time.Second},
		{time.Second, 3 * time.Second},
	} {
		if got := attemptTimeoutFor(c.target); got != c.want {
			t.Errorf("attemptTimeoutFor(%v) = %v, want %v", c.target, got, c.want)
		}
	}
	// Before the first window is judged, the transactions seen so far set the scale.
	p := newPacer(Options{})
	if got := p.LatencyScale(); got != 0 {
		t.Errorf("scale before any transaction = %v, want 0", got)
	}
	p.Observe(t0, 40*time.Millisecond, 1, nil)
	if got, want := p.LatencyScale(), 120*time.Millisecond; got != want {
		t.Errorf("scale after a 40ms transaction = %v, want %v (3 × its latency)", got, want)
	}
}

// A migration that starts during an etcd outage meets it first in the space reading,
// before any transaction: the clients' requests answered meanwhile are excused as a
// transaction's outage excuses them. Before, a killed etcd leader's 7 s client requests
// were judged in the migration's first windows and halved its rate.
func TestSpaceReadingOutageExcusesClients(t *testing.T) {
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{fmt.Sprintf("http://127.0.0.1:%d", port)}, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	serving := NewServingLatency(clock.RealClock{})
	for range minServingBaselineSamples {
		serving.Observe(RequestRead, 5*time.Millisecond)
	}
	g := NewWriter(WriterOptions{Client: cli, Clock: clock.RealClock{}, MaxBatch: 8,
		Pacing: Options{Serving: serving}, Logger: ktesting.NewLogger(t, ktesting.NewConfig())})
	defer g.Close()
	time.Sleep(10 * time.Millisecond)
	serving.Observe(RequestRead, 5*time.Millisecond)
	ctx, cancel := context.WithTimeout(t.Context(), maxEtcdAttemptTimeout+time.Second)
	defer cancel()
	start := time.Now()
	if err := g.admit(ctx, 100); err == nil {
		t.Fatal("admitted a write with etcd unreachable")
	}
	g.mu.Lock()
	until := g.excuseServingUntil
	g.mu.Unlock()
	if until.Before(start.Add(etcdRequestTimeout)) {
		t.Fatalf("clients excused until %v after the failed space reading; want until at least etcd's request timeout after it began", until.Sub(start))
	}
	if n := len(drainRead(serving)); n != 0 {
		t.Fatalf("%d client requests answered during the outage left to judge, want none", n)
	}
}
