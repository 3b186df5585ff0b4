package pace

import (
	"context"
	"math"
	"slices"
	"testing"
	"time"

	"golang.org/x/time/rate"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestVerifyFinishesWithinTheBudget: a paced re-scan reads at the clients' pace while
// that finishes in time, and faster once it would not: its revision would be compacted.
func TestVerifyFinishesWithinTheBudget(t *testing.T) {
	clk := clocktesting.NewFakeClock(t0)
	g := &Writer{clock: clk, pacer: newPacer(Options{})}
	g.servingBaselines = servingBaselines{RequestRead: 5 * time.Millisecond}
	g.pacer.SetServingBaseline(g.servingBaselines)
	g.pacer.rate = 10
	g.pacer.clientsSlowed = true // the writes ended with their clients slowed: the re-scan starts paced
	r := g.ReadPacer()
	ctx := context.Background()
	r.Resource(2400)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != readCost*10 {
		t.Errorf("limit %v/s with time to spare, want the pace %v/s", got, readCost*10)
	}
	clk.Step(verifyBudget - 2*time.Second)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != 1200 {
		t.Errorf("limit %v/s with 2,400 objects left and 2s to go, want 1200/s", got)
	}
	clk.Step(3 * time.Second)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := r.limiter.Limit(); got != rate.Inf {
		t.Errorf("limit %v past the budget, want no limit", got)
	}
	var none *ReadPacer
	none.Resource(10)
	if err := none.Wait(ctx, 5); err != nil {
		t.Errorf("no pacing waited: %v", err)
	}
}

// TestVerifyIsSlowedOnlyWhileClientsAre: the re-scan starts at readCost × the writes'
// rate, doubles while the clients are within the targets the writes ended with (a
// re-measured one included), halves when they are not, and never goes below readCost ×
// the writes' floor.
func TestVerifyIsSlowedOnlyWhileClientsAre(t *testing.T) {
	clk := clocktesting.NewFakeClock(t0)
	g := &Writer{clock: clk, pacer: newPacer(Options{})}
	g.servingBaselines = servingBaselines{RequestRead: 20 * time.Millisecond}
	g.pacer.SetServingBaseline(g.servingBaselines)
	g.pacer.rate = 100
	g.pacer.clientsSlowed = true // the writes ended with their clients slowed: the re-scan starts paced
	// The writes re-measured the GETs' target: 30ms became 60ms.
	g.pacer.pops[RequestRead].target = 60 * time.Millisecond
	r := g.ReadPacer()
	if got := r.pacer.Rate(); got != readCost*100 {
		t.Fatalf("start %v/s, want readCost × the writes' rate %v/s", got, readCost*100.0)
	}
	now := t0
	window := func(clients time.Duration) {
		t.Helper()
		for at := r.pacer.last.At; r.pacer.last.At == at; { // until the window ends
			now = now.Add(100 * time.Millisecond)
			for range 10 {
				r.pacer.ObserveServing(RequestRead, clients)
			}
			r.pacer.Observe(now, 5*time.Millisecond, int(r.pacer.Rate()/10), nil)
		}
	}
	window(10 * time.Millisecond) // the first window sets the etcd latency baseline, and doubles
	if got := r.pacer.Rate(); got != 2*readCost*100 || r.pacer.last.Change != "baseline, double" {
		t.Fatalf("after the first window: %v/s (%s), want %v/s (baseline, double)", got, r.pacer.last.Change, 2*readCost*100.0)
	}
	for _, want := range []float64{800, 1600, 3200} {
		window(45 * time.Millisecond) // within the inherited 60ms, above the first 30ms
		if got := r.pacer.Rate(); got != want {
			t.Fatalf("after a window within target: %v/s, want %v/s (%s)", got, want, r.pacer.last.Change)
		}
	}
	window(200 * time.Millisecond)
	if got := r.pacer.Rate(); got != 1600 {
		t.Fatalf("after a window of slowed clients: %v/s, want 1600/s", got)
	}
	for range 12 {
		window(300 * time.Millisecond)
	}
	if got := r.pacer.Rate(); got != readCost*DefaultMinRate {
		t.Fatalf("after slowed clients throughout: %v/s, want the floor %v/s", got, readCost*DefaultMinRate)
	}
}

// TestVerifyStartsUnlimitedAfterCalmWrites: when the writes' last judgement found the
// clients within target, the re-scan reads at full speed until a window finds them
// slowed; that window halves what it achieved, and calm windows raise it again as they
// do the writes'.
func TestVerifyStartsUnlimitedAfterCalmWrites(t *testing.T) {
	clk := clocktesting.NewFakeClock(t0)
	g := &Writer{clock: clk, pacer: newPacer(Options{})}
	g.servingBaselines = servingBaselines{RequestRead: 20 * time.Millisecond}
	g.pacer.SetServingBaseline(g.servingBaselines)
	g.pacer.rate = 290 // halved by the writes for an etcd hiccup; their clients were calm
	r := g.ReadPacer()
	if got := r.pacer.Rate(); !math.IsInf(got, 1) {
		t.Fatalf("start %v/s, want no limit after writes whose clients were within target", got)
	}
	now := t0
	// Each window: 10 transactions 100ms apart of 1,000 objects (10,000/s), each
	// after 10 GETs answered in clients.
	window := func(clients time.Duration, objects int) pacerVerdict {
		t.Helper()
		for at := r.pacer.last.At; r.pacer.last.At == at; {
			now = now.Add(100 * time.Millisecond)
			for range 10 {
				r.pacer.ObserveServing(RequestRead, clients)
			}
			r.pacer.Observe(now, 5*time.Millisecond, objects, nil)
		}
		return r.pacer.last
	}
	if v := window(10*time.Millisecond, 1000); !math.IsInf(r.pacer.Rate(), 1) {
		t.Fatalf("after a calm first window (%s): %v/s, want no limit", v.Change, r.pacer.Rate())
	}
	v := window(100*time.Millisecond, 1000)
	if got, want := r.pacer.Rate(), v.Achieved/2; v.Change != "decrease" || math.Abs(got-want) > 1 {
		t.Fatalf("after a window of slowed clients (%s, achieved %.0f/s): %v/s, want half of it, %v/s", v.Change, v.Achieved, got, want)
	}
	slowed, congested := r.pacer.Rate(), v.Achieved
	if v := window(10*time.Millisecond, int(slowed/10)); v.Change != "recover" || r.pacer.Rate() != (slowed+congested)/2 {
		t.Fatalf("after a calm window at %v/s (%s): %v/s, want halfway back to %v/s", slowed, v.Change, r.pacer.Rate(), congested)
	}
	// Back at the rate that slowed them, and they are within target: that slowdown
	// was not the re-scan's doing, and slow start resumes.
	back := r.pacer.Rate()
	if v := window(10*time.Millisecond, int(congested/10)); v.Change != "double" || r.pacer.Rate() != 2*back {
		t.Fatalf("after a calm window at %v/s (%s): %v/s, want %v/s", back, v.Change, r.pacer.Rate(), 2*back)
	}
}

// TestVerifyRebaselinesClientsSlowerByThemselves: the writes' clients were within
// target at 500 objects/s; the re-scan, reading far below readCost × that, finds a
// follower's clients slowed whatever it does: it holds, then re-baselines them and
// goes back to the calm rate, instead of halving to its floor.
func TestVerifyRebaselinesClientsSlowerByThemselves(t *testing.T) {
	clk := clocktesting.NewFakeClock(t0)
	g := &Writer{clock: clk, pacer: newPacer(Options{})}
	g.servingBaselines = servingBaselines{RequestRead: 20 * time.Millisecond}
	g.pacer.SetServingBaseline(g.servingBaselines)
	g.pacer.ObserveMember("apiserver-2", RequestRead, 10*time.Millisecond, nil)
	g.pacer.rate, g.pacer.calmRate, g.pacer.clientsSlowed = 100, 500, true
	r := g.ReadPacer()
	now := t0
	var changes []string
	for range 4 {
		for at := r.pacer.last.At; r.pacer.last.At == at; {
			now = now.Add(100 * time.Millisecond)
			for range 10 {
				r.pacer.ObserveServing(RequestRead, 10*time.Millisecond)
			}
			slow := make([]time.Duration, 10)
			for i := range slow {
				slow[i] = 40 * time.Millisecond // target 15ms
			}
			r.pacer.ObserveMember("apiserver-2", RequestRead, 10*time.Millisecond, slow)
			r.pacer.Observe(now, 5*time.Millisecond, 20, nil) // 200 objects/s
		}
		changes = append(changes, r.pacer.last.Change)
	}
	t.Logf("windows: %v; rate %v/s; %s", changes, r.pacer.Rate(), r.pacer.SlowedBy())
	if !slices.Equal(changes[:2], []string{"hold", "rebaseline"}) {
		t.Fatalf("windows: %v; want a hold, then a re-baseline", changes)
	}
	if got := r.pacer.Rate(); got < readCost*500 {
		t.Fatalf("after the re-baseline: %v/s, want at least the calm rate %v/s", got, readCost*500.0)
	}
}
