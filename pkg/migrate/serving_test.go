package migrate

import (
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

func TestServingLatencyBaseline(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(t0)
	s := NewServingLatency(clk)

	// Too few requests for a baseline: the pacer watches etcd alone.
	for range minServingBaselineSamples - 1 {
		s.Observe(3 * time.Millisecond)
	}
	if _, ok, end := s.begin(0.9); ok {
		t.Fatal("a baseline from fewer requests than the minimum")
	} else {
		end()
	}

	// Old requests do not describe the cluster of now.
	clk.SetTime(t0.Add(servingBaselineMaxAge + time.Second))
	for range 2 * minServingBaselineSamples {
		s.Observe(5 * time.Millisecond)
	}
	for range 10 {
		s.Observe(50 * time.Millisecond)
	}
	base, ok, end := s.begin(0.9)
	if !ok || base != 5*time.Millisecond {
		t.Fatalf("baseline %v (ok %v), want the p90 of the recent requests, 5ms", base, ok)
	}

	// While migrating, requests go to the pacer, not the baseline; two migrations
	// at once both have to end before they make the baseline again.
	_, _, end2 := s.begin(0.9)
	s.Observe(200 * time.Millisecond)
	if got := s.drain(nil); len(got) != 1 || got[0] != 200*time.Millisecond {
		t.Fatalf("drained %v, want the one request answered while migrating", got)
	}
	if got := s.drain(nil); len(got) != 0 {
		t.Fatalf("drained %v twice", got)
	}
	end()
	end() // ending twice is harmless
	s.Observe(300 * time.Millisecond)
	end2()
	if got := s.drain(nil); len(got) != 0 {
		t.Fatalf("%v still pending once no migration writes", got)
	}
	base, _, end = s.begin(1)
	end()
	if base != 50*time.Millisecond {
		t.Errorf("the baseline's slowest request %v, want 50ms: requests answered while migrating must not make it", base)
	}

	// The ring keeps the latest servingBaselineSamples.
	for range servingBaselineSamples {
		s.Observe(time.Millisecond)
	}
	if base, _, end = s.begin(1); base != time.Millisecond {
		t.Errorf("baseline %v after a full ring of 1ms requests", base)
	}
	end()

	var none *ServingLatency
	none.Observe(time.Second)
	if _, ok, end := none.begin(0.9); ok {
		t.Error("a nil recorder has a baseline")
	} else {
		end()
	}
}
