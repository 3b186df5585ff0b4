package healthz

import (
	"context"
	"errors"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"
	clocktesting "k8s.io/utils/clock/testing"
)

func TestMain(m *testing.M) { goleak.VerifyTestMain(m) }

// fakeProbe is a plugin whose health the test sets; it counts calls and can block them.
type fakeProbe struct {
	name  string
	calls atomic.Int64
	mu    sync.Mutex
	err   error
	gate  chan struct{} // when non-nil, Check waits for it
}

func (p *fakeProbe) Name() string { return p.name }

func (p *fakeProbe) Check(ctx context.Context) error {
	p.calls.Add(1)
	p.mu.Lock()
	gate, err := p.gate, p.err
	p.mu.Unlock()
	if gate != nil {
		select {
		case <-gate:
		case <-ctx.Done():
			return ctx.Err()
		}
	}
	return err
}

func (p *fakeProbe) set(err error) {
	p.mu.Lock()
	p.err = err
	p.mu.Unlock()
}

func newChecker() (*Checker, *clocktesting.FakeClock) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	return New(Options{Clock: clk}), clk
}

func TestNameAndNoProviders(t *testing.T) {
	c, _ := newChecker()
	if c.Name() != "kms-providers" {
		t.Fatalf("Name() = %q", c.Name())
	}
	// H1: present and passing with no KMS provider configured.
	if err := c.Check(httptest.NewRequest("GET", "/healthz/kms-providers", nil)); err != nil {
		t.Fatalf("no providers: %v", err)
	}
}

// H2: one of two plugins down, then the other, then both (aggregated), then recovery.
func TestFailuresNamedAggregatedAndRecovered(t *testing.T) {
	c, clk := newChecker()
	a, b := &fakeProbe{name: "kms-a"}, &fakeProbe{name: "kms-b"}
	c.Swap(a, b)
	ctx := context.Background()
	step := func(wantErr bool, want, notWant []string) {
		t.Helper()
		clk.Step(DefaultOKTTL) // past every cache period
		err := c.CheckContext(ctx)
		if (err != nil) != wantErr {
			t.Fatalf("err = %v, want error: %v", err, wantErr)
		}
		for _, w := range want {
			if err == nil || !strings.Contains(err.Error(), w) {
				t.Fatalf("error %v does not contain %q", err, w)
			}
		}
		for _, w := range notWant {
			if err != nil && strings.Contains(err.Error(), w) {
				t.Fatalf("error %v contains %q", err, w)
			}
		}
	}
	step(false, nil, nil)
	a.set(errors.New("plugin a unreachable"))
	step(true, []string{`kms-provider-0: provider "kms-a": plugin a unreachable`}, []string{"kms-provider-1"})
	a.set(nil)
	b.set(errors.New("plugin b unreachable"))
	step(true, []string{`kms-provider-1: provider "kms-b": plugin b unreachable`}, []string{"kms-provider-0"})
	a.set(errors.New("plugin a unreachable"))
	step(true, []string{"kms-provider-0", "kms-provider-1", "plugin a unreachable", "plugin b unreachable"}, nil)
	a.set(nil)
	b.set(nil)
	step(false, nil, nil)
}

// A probe storm costs one plugin call per cache period: 20 s after success, 3 s after
// failure.
func TestCacheAndStormCoalescing(t *testing.T) {
	c, clk := newChecker()
	p := &fakeProbe{name: "kms", gate: make(chan struct{})}
	c.Swap(p)

	const storm = 200
	var wg sync.WaitGroup
	errs := make(chan error, storm)
	for range storm {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- c.CheckContext(context.Background())
		}()
	}
	// Wait until the single call is running, then let it answer.
	waitFor(t, func() bool { return p.calls.Load() >= 1 })
	p.mu.Lock()
	close(p.gate)
	p.gate = nil
	p.mu.Unlock()
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("storm: %v", err)
		}
	}
	if n := p.calls.Load(); n != 1 {
		t.Fatalf("storm of %d probes made %d plugin calls, want 1", storm, n)
	}

	clk.Step(DefaultOKTTL - time.Millisecond)
	_ = c.CheckContext(context.Background())
	if n := p.calls.Load(); n != 1 {
		t.Fatalf("success cached for less than %v: %d calls", DefaultOKTTL, n)
	}
	clk.Step(time.Millisecond)
	_ = c.CheckContext(context.Background())
	if n := p.calls.Load(); n != 2 {
		t.Fatalf("success cached for more than %v: %d calls", DefaultOKTTL, n)
	}

	p.set(errors.New("down"))
	clk.Step(DefaultOKTTL)
	if err := c.CheckContext(context.Background()); err == nil {
		t.Fatal("failure not reported")
	}
	p.set(nil)
	clk.Step(DefaultFailureTTL - time.Millisecond)
	if err := c.CheckContext(context.Background()); err == nil {
		t.Fatalf("failure cached for less than %v", DefaultFailureTTL)
	}
	clk.Step(time.Millisecond)
	if err := c.CheckContext(context.Background()); err != nil {
		t.Fatalf("failure cached for more than %v: %v", DefaultFailureTTL, err)
	}
	if n := p.calls.Load(); n != 4 {
		t.Fatalf("calls = %d, want 4", n)
	}
}

// The check follows Swap: results cached for old providers are not reused.
func TestSwapReplacesProvidersAndCache(t *testing.T) {
	c, _ := newChecker()
	old := &fakeProbe{name: "old", err: errors.New("old plugin down")}
	c.Swap(old)
	if err := c.CheckContext(context.Background()); err == nil {
		t.Fatal("old failure not reported")
	}
	fresh := &fakeProbe{name: "new"}
	c.Swap(fresh)
	if err := c.CheckContext(context.Background()); err != nil {
		t.Fatalf("after swap: %v", err)
	}
	c.Swap()
	if err := c.CheckContext(context.Background()); err != nil {
		t.Fatalf("after swap to none: %v", err)
	}
}

// A waiting request gives up with its own context; the call it waited for still
// completes and is cached for the others.
func TestWaiterHonoursContext(t *testing.T) {
	c, _ := newChecker()
	p := &fakeProbe{name: "slow", gate: make(chan struct{})}
	c.Swap(p)
	leader := make(chan error, 1)
	go func() { leader <- c.CheckContext(context.Background()) }()
	waitFor(t, func() bool { return p.calls.Load() == 1 })
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.CheckContext(ctx); err == nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("waiter err = %v, want context canceled", err)
	}
	p.mu.Lock()
	close(p.gate)
	p.gate = nil
	p.mu.Unlock()
	if err := <-leader; err != nil {
		t.Fatalf("leader: %v", err)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 10s")
		}
		time.Sleep(time.Millisecond)
	}
}
