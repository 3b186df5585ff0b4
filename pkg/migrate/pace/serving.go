package pace

// The apiserver's own request latency, as a signal for the pacer. On a control plane
// whose CPUs are shared by etcd, the apiserver and the migration, etcd's transaction
// latency can stay low while the migration's re-encryption and the watch cache's
// decoding of every rewritten object slow the clients down: what the cluster's own
// traffic sees must be measured where it is served.

import (
	"fmt"
	"math/rand/v2"
	"strings"
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
	// servingBaselineSlot: the baseline is kept per class and minute, each a uniform
	// sample of at most servingSlotSamples of its requests (reservoir sampling).
	servingBaselineSlot  = time.Minute
	servingBaselineSlots = int(servingBaselineMaxAge / servingBaselineSlot)
	servingSlotSamples   = 1024
	// minServingBaselineSamples a class's baseline needs: with fewer requests of a
	// class there is too little of its traffic to judge (and to slow down for); its
	// requests are not judged. With no class that has one, the pacer watches etcd
	// alone.
	minServingBaselineSamples = 50
	// maxPendingServing bounds the samples of one class kept for a pacer between its
	// windows.
	maxPendingServing = 1 << 14
)

// RequestClass is the population a client request's latency is judged in: each class
// is compared with its own baseline, never with another's. A LIST of 10,000 Secrets
// takes hundreds of milliseconds where a GET takes one; judged as one population, a
// controller's burst of LISTs during a migration read as the GETs slowed down (a
// congestion), and a baseline with LISTs in its tail hid GETs slowed threefold.
type RequestClass uint8

// Request classes.
const (
	// RequestRead is a read of one object (GET).
	RequestRead RequestClass = iota
	// RequestWrite is a write of one object (create, update, patch, delete).
	RequestWrite
	// RequestList is a read or a delete of many objects (LIST, deletecollection).
	RequestList
	// RequestOther is a request for no resource: discovery, health checks, metrics.
	RequestOther

	numRequestClasses = iota
)

// String names the class as the logs and transcripts do.
func (c RequestClass) String() string {
	switch c {
	case RequestRead:
		return "get"
	case RequestWrite:
		return "write"
	case RequestList:
		return "list"
	case RequestOther:
		return "other"
	}
	return "unknown"
}

// ClassOf is the class of a request: resource says it is a request for a resource
// (k8s.io/apiserver's RequestInfo.IsResourceRequest) and verb is its verb
// (RequestInfo.Verb: get, list, create, update, patch, delete, deletecollection, …).
// Watches are long-running and not timed at all.
func ClassOf(resource bool, verb string) RequestClass {
	if !resource {
		return RequestOther
	}
	switch verb {
	case "get":
		return RequestRead
	case "list", "deletecollection":
		return RequestList
	case "create", "update", "patch", "delete":
		return RequestWrite
	}
	return RequestOther
}

// servingBaselines are the clients' p99 per class before a migration; 0: the class
// has no baseline (too few of its requests), and its requests are not judged.
type servingBaselines [numRequestClasses]time.Duration

// any says whether any class has a baseline.
func (b servingBaselines) any() bool { return b != servingBaselines{} }

// String lists the classes' baselines, for the logs.
func (b servingBaselines) String() string {
	var parts []string
	for c, d := range b {
		if d > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", RequestClass(c), d))
		}
	}
	return strings.Join(parts, ", ")
}

// servingSamples are latencies per class.
type servingSamples [numRequestClasses][]time.Duration

// ServingLatency collects how long the apiserver took to answer its clients (the
// handler chain feeds it; see layer.Layer.AddServingLatency), per RequestClass.
// Requests answered while no migration writes make each class's baseline; those
// answered while one writes are handed to its pacer, which slows the migration down
// when a class is slower than its own baseline allows (Options.ServingFactor). Safe
// for concurrent use; a nil *ServingLatency records nothing.
type ServingLatency struct {
	clock clock.PassiveClock

	mu sync.Mutex
	// migrating counts the migrations writing now, since the first of them began.
	migrating      int
	migratingSince time.Time
	// baseline holds, per class, the requests answered while none wrote, a slot per
	// minute of the last servingBaselineMaxAge (indexed by the minute, modulo).
	baseline [numRequestClasses][servingBaselineSlots]servingSlot
	rng      *rand.Rand
	// pending holds the samples taken while a migration writes, until its pacer
	// drains them.
	pending servingSamples
}

// servingSlot is one minute of a class's baseline.
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

// Observe records one answered request of class c that took latency. A request that
// arrived before the migrations writing now began is not judged: it was not theirs to
// slow, and one that waited out an etcd leader election before the migration started
// (7 s) halved the rate of a migration that had not met the outage at all.
func (s *ServingLatency) Observe(c RequestClass, latency time.Duration) {
	if s == nil || c >= numRequestClasses {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.migrating > 0 {
		if s.clock.Now().Add(-latency).Before(s.migratingSince) {
			return
		}
		if len(s.pending[c]) < maxPendingServing {
			s.pending[c] = append(s.pending[c], latency)
		}
		return
	}
	start := s.clock.Now().Truncate(servingBaselineSlot)
	sl := &s.baseline[c][int(start.UnixNano()/int64(servingBaselineSlot))%servingBaselineSlots]
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
// each class's baseline quantile q (0 for a class with too few recent samples).
func (s *ServingLatency) begin(q float64) (baselines servingBaselines, end func()) {
	if s == nil {
		return baselines, func() {}
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	now := s.clock.Now()
	var recent []time.Duration
	for c := range baselines {
		recent = recent[:0]
		for _, sl := range s.baseline[c] {
			if now.Sub(sl.start) < servingBaselineMaxAge {
				recent = append(recent, sl.samples...)
			}
		}
		if len(recent) >= minServingBaselineSamples {
			baselines[c] = quantile(recent, q)
		}
	}
	if s.migrating++; s.migrating == 1 {
		s.migratingSince = now
	}
	var once sync.Once
	return baselines, func() {
		once.Do(func() {
			s.mu.Lock()
			defer s.mu.Unlock()
			if s.migrating--; s.migrating == 0 {
				for c := range s.pending {
					s.pending[c] = s.pending[c][:0]
				}
			}
		})
	}
}

// drain replaces buf's samples with those taken while migrating and forgets them. With
// several migrations at once each sees a share: any of them slows down when its share
// is slow, which is what matters.
func (s *ServingLatency) drain(buf *servingSamples) {
	for c := range buf {
		buf[c] = buf[c][:0]
	}
	if s == nil {
		return
	}
	s.mu.Lock()
	defer s.mu.Unlock()
	for c := range s.pending {
		buf[c] = append(buf[c], s.pending[c]...)
		s.pending[c] = s.pending[c][:0]
	}
}

// MembersServing hands a migration's pacer what the clients of the other apiservers
// saw while it wrote (Options.Members). Safe for concurrent use.
type MembersServing interface {
	// DrainMembers calls f for each member and class with the requests it reported
	// since the last call, and that class's p99 there before the migration (0: too
	// few requests for a baseline; they are not judged), then forgets them.
	DrainMembers(f func(member string, c RequestClass, baseline time.Duration, latencies []time.Duration))
}

// maxShareSamples is the most requests of one class a ServingShare hands over at a
// time: a uniform sample of them when there were more. A thousand a second per class
// is more than a window's judgement needs (minServingSamples), and bounds a report.
const maxShareSamples = 1024

// ServingShare is this apiserver's clients' latency during a migration another
// apiserver runs: from Share until End, requests answered here make no baseline
// (the migration may slow them), and Take hands them over, with the baselines they
// made before, for the migration's leader to judge (see MembersServing).
type ServingShare struct {
	s         *ServingLatency
	baselines servingBaselines
	end       func()
	buf       servingSamples
	rng       *rand.Rand
}

// Share starts a share; a nil *ServingLatency's share takes nothing.
func (s *ServingLatency) Share() *ServingShare {
	b, end := s.begin(servingQuantile)
	return &ServingShare{s: s, baselines: b, end: end, rng: rand.New(rand.NewPCG(uint64(time.Now().UnixNano()), 0x5a4e))}
}

// Take calls f for each class with a baseline or requests since the last Take: its
// p99 before the share began (0: none) and at most maxShareSamples of its requests
// since (a uniform sample of them).
func (sh *ServingShare) Take(f func(c RequestClass, baseline time.Duration, latencies []time.Duration)) {
	sh.s.drain(&sh.buf)
	for c, ds := range sh.buf {
		if len(ds) > maxShareSamples {
			// A partial Fisher–Yates shuffle: its first maxShareSamples are a uniform sample.
			for i := range maxShareSamples {
				j := i + sh.rng.IntN(len(ds)-i)
				ds[i], ds[j] = ds[j], ds[i]
			}
			ds = ds[:maxShareSamples]
		}
		if sh.baselines[c] > 0 || len(ds) > 0 {
			f(RequestClass(c), sh.baselines[c], ds)
		}
	}
}

// End ends the share: requests answered from now on make the baseline again.
func (sh *ServingShare) End() { sh.end() }

// ParseRequestClass reads a class's name (RequestClass.String).
func ParseRequestClass(s string) (RequestClass, bool) {
	for c := range RequestClass(numRequestClasses) {
		if c.String() == s {
			return c, true
		}
	}
	return 0, false
}
