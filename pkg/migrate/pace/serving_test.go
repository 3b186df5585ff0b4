package pace

import (
	"math/rand/v2"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

func TestServingLatencyBaseline(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(t0)
	s := NewServingLatency(clk)

	// Too few requests for a baseline: the pacer watches etcd alone.
	for range minServingBaselineSamples - 1 {
		s.Observe(RequestRead, 3*time.Millisecond)
	}
	if _, ok, end := beginRead(s, 0.9); ok {
		t.Fatal("a baseline from fewer requests than the minimum")
	} else {
		end()
	}

	// Old requests do not describe the cluster of now.
	clk.SetTime(t0.Add(servingBaselineMaxAge + time.Second))
	for range 2 * minServingBaselineSamples {
		s.Observe(RequestRead, 5*time.Millisecond)
	}
	for range 10 {
		s.Observe(RequestRead, 50*time.Millisecond)
	}
	base, ok, end := beginRead(s, 0.9)
	if !ok || base != 5*time.Millisecond {
		t.Fatalf("baseline %v (ok %v), want the p90 of the recent requests, 5ms", base, ok)
	}

	// While migrating, requests go to the pacer, not the baseline; two migrations
	// at once both have to end before they make the baseline again.
	_, _, end2 := beginRead(s, 0.9)
	s.Observe(RequestRead, time.Millisecond) // arrived before the migrations began: not theirs
	clk.SetTime(clk.Now().Add(time.Second))
	s.Observe(RequestRead, 200*time.Millisecond)
	if got := drainRead(s); len(got) != 1 || got[0] != 200*time.Millisecond {
		t.Fatalf("drained %v, want the one request that arrived and was answered while migrating", got)
	}
	if got := drainRead(s); len(got) != 0 {
		t.Fatalf("drained %v twice", got)
	}
	end()
	end() // ending twice is harmless
	s.Observe(RequestRead, 300*time.Millisecond)
	end2()
	if got := drainRead(s); len(got) != 0 {
		t.Fatalf("%v still pending once no migration writes", got)
	}
	base, _, end = beginRead(s, 1)
	end()
	if base != 50*time.Millisecond {
		t.Errorf("the baseline's slowest request %v, want 50ms: requests answered while migrating must not make it", base)
	}

	// A minute keeps a uniform sample of at most servingSlotSamples of its requests:
	// 10,000 of 1ms and 100 of 40ms leave about 1% of 40ms in it, so the p99 is near
	// the boundary and the p95 is 1ms.
	clk.SetTime(t0.Add(3 * servingBaselineMaxAge))
	s.rng = rand.New(rand.NewPCG(1, 2)) // a fixed sample: the test cannot flake
	for i := range 10_100 {
		if i%101 == 0 {
			s.Observe(RequestRead, 40*time.Millisecond)
		} else {
			s.Observe(RequestRead, time.Millisecond)
		}
	}
	s.mu.Lock()
	kept := 0
	for _, sl := range s.baseline[RequestRead] {
		if sl.start.Equal(clk.Now().Truncate(servingBaselineSlot)) {
			kept += len(sl.samples)
		}
	}
	s.mu.Unlock()
	if kept != servingSlotSamples {
		t.Errorf("%d samples kept of one minute's 10,100 requests, want %d", kept, servingSlotSamples)
	}
	if base, _, end = beginRead(s, 0.95); base != time.Millisecond {
		t.Errorf("p95 %v of a minute of 1%% 40ms, want 1ms", base)
	}
	end()
	if base, _, end = beginRead(s, 1); base != 40*time.Millisecond {
		t.Errorf("slowest %v of a minute of 1%% 40ms requests, want 40ms (the sample lost them)", base)
	}
	end()

	// The baseline spans the last 10 minutes: a slow minute 9 minutes ago still counts,
	// and leaves it once it is older.
	clk.SetTime(clk.Now().Add(time.Minute))
	for range 100 {
		s.Observe(RequestRead, 2*time.Millisecond)
	}
	clk.SetTime(clk.Now().Add(8 * time.Minute))
	if base, _, end = beginRead(s, 1); base != 40*time.Millisecond {
		t.Errorf("slowest %v, want the 40ms of 9 minutes ago", base)
	}
	end()
	clk.SetTime(clk.Now().Add(2 * time.Minute))
	for range minServingBaselineSamples {
		s.Observe(RequestRead, 3*time.Millisecond)
	}
	if base, _, end = beginRead(s, 1); base != 3*time.Millisecond {
		t.Errorf("slowest %v, want 3ms: every earlier minute is more than 10 minutes old", base)
	}
	end()

	var none *ServingLatency
	none.Observe(RequestRead, time.Second)
	if _, ok, end := beginRead(none, 0.9); ok {
		t.Error("a nil recorder has a baseline")
	} else {
		end()
	}
}

// beginRead is begin for the tests of one class: RequestRead's baseline, and whether
// it has one.
func beginRead(s *ServingLatency, q float64) (time.Duration, bool, func()) {
	b, end := s.begin(q)
	return b[RequestRead], b[RequestRead] > 0, end
}

// drainRead drains s and returns the RequestRead samples.
func drainRead(s *ServingLatency) []time.Duration {
	var buf servingSamples
	s.drain(&buf)
	return buf[RequestRead]
}

// TestServingShare: a share hands over the requests answered since it began, with
// the baselines made before it, and samples a class down to maxShareSamples.
func TestServingShare(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(t0)
	s := NewServingLatency(clk)
	for range 2 * minServingBaselineSamples {
		s.Observe(RequestRead, 4*time.Millisecond)
	}
	sh := s.Share()
	clk.SetTime(t0.Add(time.Second))
	for i := range 3 * maxShareSamples {
		s.Observe(RequestRead, time.Duration(i)*time.Microsecond)
	}
	s.Observe(RequestList, time.Second) // no baseline: handed over, not judged here
	got := map[RequestClass][]time.Duration{}
	baselines := map[RequestClass]time.Duration{}
	sh.Take(func(c RequestClass, baseline time.Duration, latencies []time.Duration) {
		baselines[c], got[c] = baseline, append([]time.Duration(nil), latencies...)
	})
	if baselines[RequestRead] != 4*time.Millisecond || len(got[RequestRead]) != maxShareSamples {
		t.Fatalf("GETs: baseline %v and %d latencies, want 4ms and %d", baselines[RequestRead], len(got[RequestRead]), maxShareSamples)
	}
	// A uniform sample of 0..3071 µs has a mean near 1,536 µs (σ ≈ 23 µs); the first
	// or the last third of them would have 512 or 2,560.
	var sum time.Duration
	for _, d := range got[RequestRead] {
		sum += d
	}
	if mean := sum / maxShareSamples; mean < 1400*time.Microsecond || mean > 1700*time.Microsecond {
		t.Errorf("the sample's mean is %v, want about 1.536ms: not a uniform sample of the requests", mean)
	}
	if baselines[RequestList] != 0 || len(got[RequestList]) != 1 {
		t.Fatalf("LISTs: baseline %v and %d latencies, want none and 1", baselines[RequestList], len(got[RequestList]))
	}
	n := 0
	sh.Take(func(_ RequestClass, _ time.Duration, latencies []time.Duration) { n += len(latencies) })
	if n != 0 {
		t.Fatalf("a second Take handed %d requests over again", n)
	}
	// Ended, the requests make the baseline again.
	sh.End()
	s.Observe(RequestRead, 4*time.Millisecond)
	sh.Take(func(_ RequestClass, _ time.Duration, latencies []time.Duration) { n += len(latencies) })
	if n != 0 {
		t.Fatalf("an ended share took %d requests", n)
	}
}
