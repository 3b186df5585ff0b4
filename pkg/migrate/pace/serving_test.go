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
