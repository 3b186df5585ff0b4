package migrate

// The apiserver's own request latency, as a signal for the pacer. On a control plane
// whose CPUs are shared by etcd, the apiserver and the migration, etcd's transaction
// latency can stay low while the migration's re-encryption and the watch cache's
// decoding of every rewritten object slow the clients down: what the cluster's own
// traffic sees must be measured where it is served.

import (
	"sync"
	"time"

	"k8s.io/utils/clock"
)

const (
	// servingBaselineSamples is how many of the latest requests answered while no
	// migration wrote make the baseline.
	servingBaselineSamples = 1024
	// servingBaselineMaxAge: older samples do not describe the cluster of now.
	servingBaselineMaxAge = 10 * time.Minute
	// minServingBaselineSamples a baseline needs: with fewer requests there is too
	// little traffic to judge (and to slow down); the pacer watches etcd alone.
	minServingBaselineSamples = 50
	// maxPendingServing bounds the samples kept for a pacer between its windows.
	maxPendingServing = 1 << 14
)

// ServingLatency collects how long the apiserver took to answer its clients (the
// handler chain feeds it; see layer.Layer.AddServingLatency). Requests answered while
// no migration writes make the baseline; those answered while one writes are handed to
// its pacer, which slows the migration down when they are slower than the baseline
// allows (PacingOptions.ServingFactor). Safe for concurrent use; a nil
// *ServingLatency records nothing.
type ServingLatency struct {
	clock clock.PassiveClock

	mu sync.Mutex
	// migrating counts the migrations writing now.
	migrating int
	// baseline is a ring of the latest samples taken while none wrote.
	baseline     [servingBaselineSamples]servingSample
	baselineNext int
	baselineLen  int
	// pending holds the samples taken while a migration writes, until its pacer
	// drains them.
	pending []time.Duration
}

type servingSample struct {
	at      time.Time
	latency time.Duration
}

// NewServingLatency returns an empty recorder on clk (nil: the real clock).
func NewServingLatency(clk clock.PassiveClock) *ServingLatency {
	if clk == nil {
		clk = clock.RealClock{}
	}
	return &ServingLatency{clock: clk}
}

// Observe records one answered request that took latency.
func (s *ServingLatency) Observe(latency time.Duration) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.migrating > 0 {
		if len(s.pending) < maxPendingServing {
			s.pending = append(s.pending, latency)
		}
		return
	}
	s.baseline[s.baselineNext] = servingSample{at: s.clock.Now(), latency: latency}
	s.baselineNext = (s.baselineNext + 1) % servingBaselineSamples
	s.baselineLen = min(s.baselineLen+1, servingBaselineSamples)
}

// begin marks a migration as writing until the returned func is called, and returns
// the baseline's quantile q (ok false: too few recent samples to have one).
func (s *ServingLatency) begin(q float64) (baseline time.Duration, ok bool, end func()) {
	if s == nil {
		return 0, false, func() {}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock.Now()
	recent := make([]time.Duration, 0, s.baselineLen)
	for i := range s.baselineLen {
		if sm := s.baseline[i]; now.Sub(sm.at) <= servingBaselineMaxAge {
			recent = append(recent, sm.latency)
		}
	}
	if len(recent) >= minServingBaselineSamples {
		baseline, ok = quantile(recent, q), true
	}
	s.migrating++
	var once sync.Once
	return baseline, ok, func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.migrating--; s.migrating == 0 {
				s.pending = s.pending[:0]
			}
		})
	}
}

// drain appends the samples taken while migrating to buf and forgets them. With
// several migrations at once each sees a share: any of them slows down when its share
// is slow, which is what matters.
func (s *ServingLatency) drain(buf []time.Duration) []time.Duration {
	if s == nil {
		return buf
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	buf = append(buf, s.pending...)
	s.pending = s.pending[:0]
	return buf
}
