package pace

// The apiserver's own request latency, as a signal for the pacer. On a control plane
// whose CPUs are shared by etcd, the apiserver and the migration, etcd's transaction
// latency can stay low while the migration's re-encryption and the watch cache's
// decoding of every rewritten object slow the clients down: what the cluster's own
// traffic sees must be measured where it is served.

import (
	"math/rand/v2"
	"sync"
	"time"

	"k8s.io/utils/clock"
)

const (
	// servingBaselineMaxAge: older requests do not describe the cluster of now. The
	// baseline spans all of it, so that it holds what the cluster does every few
	// minutes anyway (a garbage collection of a large watch cache, etcd's compaction):
	// a baseline of the last half minute at a million Secrets was a quiet spell, and
	// every later collection looked like the migration's doing.
	servingBaselineMaxAge = 10 * time.Minute
	// servingBaselineSlot: the baseline is kept per minute, each a uniform sample of at
	// most servingSlotSamples of its requests (reservoir sampling).
	servingBaselineSlot  = time.Minute
	servingBaselineSlots = int(servingBaselineMaxAge / servingBaselineSlot)
	servingSlotSamples   = 1024
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
// allows (Options.ServingFactor). Safe for concurrent use; a nil
// *ServingLatency records nothing.
type ServingLatency struct {
	clock clock.PassiveClock

	mu sync.Mutex
	// migrating counts the migrations writing now, since the first of them began.
	migrating      int
	migratingSince time.Time
	// baseline holds the requests answered while none wrote, a slot per minute of
	// the last servingBaselineMaxAge (indexed by the minute, modulo).
	baseline [servingBaselineSlots]servingSlot
	rng      *rand.Rand
	// pending holds the samples taken while a migration writes, until its pacer
	// drains them.
	pending []time.Duration
}

// servingSlot is one minute of the baseline.
type servingSlot struct {
	start   time.Time
	seen    int
	samples []time.Duration
}

// NewServingLatency returns an empty recorder on clk (nil: the real clock).
func NewServingLatency(clk clock.PassiveClock) *ServingLatency {
	if clk == nil {
		clk = clock.RealClock{}
	}
	// The sampling needs no secrecy, only independence from the requests.
	return &ServingLatency{clock: clk, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0x5e55))}
}

// Observe records one answered request that took latency. A request that arrived
// before the migrations writing now began is not judged: it was not theirs to slow,
// and one that waited out an etcd leader election before the migration started (7 s)
// halved the rate of a migration that had not met the outage at all.
func (s *ServingLatency) Observe(latency time.Duration) {
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.migrating > 0 {
		if s.clock.Now().Add(-latency).Before(s.migratingSince) {
			return
		}
		if len(s.pending) < maxPendingServing {
			s.pending = append(s.pending, latency)
		}
		return
	}
	start := s.clock.Now().Truncate(servingBaselineSlot)
	sl := &s.baseline[int(start.UnixNano()/int64(servingBaselineSlot))%servingBaselineSlots]
	if !sl.start.Equal(start) {
		sl.start, sl.seen, sl.samples = start, 0, sl.samples[:0]
	}
	sl.seen++
	if len(sl.samples) < servingSlotSamples {
		sl.samples = append(sl.samples, latency)
	} else if i := s.rng.IntN(sl.seen); i < servingSlotSamples {
		sl.samples[i] = latency
	}
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
	var recent []time.Duration
	for _, sl := range s.baseline {
		if now.Sub(sl.start) < servingBaselineMaxAge {
			recent = append(recent, sl.samples...)
		}
	}
	if len(recent) >= minServingBaselineSamples {
		baseline, ok = quantile(recent, q), true
	}
	if s.migrating++; s.migrating == 1 {
		s.migratingSince = now
	}
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
