package healthz

import (
	"context"
	"errors"
	"net/http/httptest"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/rekey-io/rekey/internal/leakcheck"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

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

func newChecker() *Checker { return New(Options{}) }

func TestNameAndNoProviders(t *testing.T) {
	c := newChecker()
	if c.Name() != "kms-providers" {
		t.Fatalf("Name() = %q", c.Name())
	}
	// Present and passing with no KMS provider configured.
	if err := c.Check(httptest.NewRequest("GET", "/healthz/kms-providers", nil)); err != nil {
		t.Fatalf("no providers: %v", err)
	}
}

// One of two plugins down, then the other, then both (aggregated), then recovery.
func TestFailuresNamedAggregatedAndRecovered(t *testing.T) {
	c := newChecker()
	a, b := &fakeProbe{name: "kms-a"}, &fakeProbe{name: "kms-b"}
	c.Swap(a, b)
	ctx := context.Background()
	step := func(wantErr bool, want, notWant []string) {
		t.Helper()
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

// The provider is the one cache in front of its plugin: the check asks it every time,
// so a plugin that turns unhealthy is reported as soon as the provider reports it.
func TestNoCacheOfItsOwn(t *testing.T) {
	c := newChecker()
	p := &fakeProbe{name: "kms"}
	c.Swap(p)
	ctx := context.Background()
	if err := c.CheckContext(ctx); err != nil {
		t.Fatal(err)
	}
	p.set(errors.New("down"))
	if err := c.CheckContext(ctx); err == nil || !strings.Contains(err.Error(), "down") {
		t.Fatalf("a failure right after a success: %v, want it reported", err)
	}
	p.set(nil)
	if err := c.CheckContext(ctx); err != nil {
		t.Fatalf("a success right after a failure: %v", err)
	}
	if n := p.calls.Load(); n != 3 {
		t.Fatalf("3 checks made %d provider calls, want 3", n)
	}
}

// The check follows Swap: results cached for old providers are not reused.
func TestSwapReplacesProvidersAndCache(t *testing.T) {
	c := newChecker()
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

// A provider's check ends with the request's context.
func TestCheckHonoursContext(t *testing.T) {
	c := newChecker()
	p := &fakeProbe{name: "slow", gate: make(chan struct{})}
	c.Swap(p)
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	if err := c.CheckContext(ctx); err == nil || !errors.Is(err, context.Canceled) {
		t.Fatalf("err = %v, want context canceled", err)
	}
}
