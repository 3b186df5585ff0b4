package pace

// Adaptive pacing of a migration's writes: additive increase, multiplicative decrease
// (AIMD, as TCP congestion control) on the latency of the migration's own etcd
// transactions and, inside an apiserver, on how fast the apiserver answers its own
// clients. A migration shares etcd and the control plane's CPUs with the cluster's own
// traffic; a slow etcd or a slower apiserver is the signal that it is taking too much.

import (
	"fmt"
	"math"
	"slices"
	"strings"
	"time"
)

// Pacing defaults.
const (
	// DefaultPacingWindow is how often the pacer judges the latencies it saw.
	DefaultPacingWindow = time.Second
	// DefaultMinTargetLatency is the lowest latency target a baseline can set: below
	// it, etcd is fast enough whatever the baseline (a 1 ms baseline must not make
	// 3 ms a congestion).
	DefaultMinTargetLatency = 20 * time.Millisecond
	// DefaultBaselineFactor: without an explicit target, a window whose p90 is more
	// than this many times the first window's p90 is congestion.
	DefaultBaselineFactor = 3
	// DefaultDecrease is the multiplicative decrease on congestion.
	DefaultDecrease = 0.5
	// DefaultIncrease is the least additive increase per calm window, in objects per
	// second; above 10 × it a calm window adds increaseFraction of the rate instead.
	DefaultIncrease = 50
	// increaseFraction of the rate is what a calm window adds at high rates: a fixed
	// 50/s would take minutes to climb back from one congestion at thousands per
	// second (a million objects at 500/s instead of 8,000/s).
	increaseFraction = 0.1
	// DefaultMinRate is the floor: a migration always makes progress.
	DefaultMinRate = 10
	// DefaultServingFactor: a window in which the apiserver answered its clients more
	// than this many times slower (at servingQuantile) than before the migration is
	// congestion.
	DefaultServingFactor = 1.5
	// DefaultServingStartRate is where a migration starts when the apiserver has
	// clients to protect (a serving baseline); it doubles per calm window from there.
	DefaultServingStartRate = 100
	// minServingSlack: a serving target is at least this far above the baseline (a
	// 2 ms baseline must not make a 3.1 ms window a congestion).
	minServingSlack = time.Millisecond
	// pacingQuantile is the quantile of etcd's latency judged.
	pacingQuantile = 0.9
	// servingQuantile is the quantile of the clients' latency judged, in a window and
	// in the baseline: the clients' promise is about their tail (p99 at most
	// ServingFactor × before), and AIMD climbs until its signal trips, so a p90 signal
	// would let the tail grow unseen.
	servingQuantile = 0.99
	// minServingSamples the clients' latency needs to be judged; fewer are kept for
	// the next window (unless they already are evidence of a slowdown: see
	// significantlyOver), and a window without a judgement of the clients does not
	// raise the rate. A p99 needs about a hundred samples: the slowest of 30 (a second
	// of a 30 requests/s workload) is above the baseline's p99 one window in four with
	// no change at all, and each such window halved the rate (a million-Secret run
	// crawled at 100–1,000 objects/s).
	minServingSamples = 100
	// servingExceedance is the share of a class's requests a p99 lets above its
	// target: the clients' promise (p99 within target) holds while at most this share
	// of them is slower than the target.
	servingExceedance = 1 - servingQuantile
	// servingSignificance is how unlikely a window's count of requests above their
	// target must be, were the clients' p99 within target, for the window to be
	// congestion (a one-sided binomial test). Judging "the window's p99 is over the
	// target" instead halved the rate on noise: of 113 requests, the p99 is the
	// second slowest, and two of 113 are above the target in 31% of windows whose
	// clients are exactly at it (a 10,000-Secret rotation left slow start at
	// 200 objects/s on a window 2% over target, and ended with the clients' p99 at
	// ×1.04–1.14 of before, far inside its ×1.5). It is the significance of a
	// window's judgement as a whole: each of the populations judged in it is tested at
	// its share (see judgedPopulations).
	servingSignificance = 0.05
	// maxServingWindows: with fewer clients than that, what arrived in this many
	// windows is judged anyway (a light workload must not hold the rate for long).
	maxServingWindows = 5
	// minSamples a window needs to be judged (one slow request is not a trend); a
	// window lasts until it has them.
	minSamples = 3
	// externalRateFraction and externalWindows: when the clients are slower than the
	// target in externalWindows judged windows in a row while the migration achieved at
	// most externalRateFraction of a rate they were answered within target at, or while
	// it was held at its floor (MinRate, the least it ever takes), the migration is not
	// what slows them (the cluster got slower by itself: an etcd member down, a node
	// under other load, clients slower than their baseline from the first window on).
	// Halving again would only starve the migration; the clients' baseline is measured
	// anew instead (see judge).
	externalRateFraction = 0.5
	externalWindows      = 2
	// maxRebaselineFactor bounds how far the clients' target can move from the one
	// the migration started with: past that the cluster is in trouble of its own, and
	// the migration slows down for such clients as before.
	maxRebaselineFactor = 4
	// FastServingFactor is PriorityFast's clients' latency factor: loose enough that
	// the migration takes what etcd gives, tight enough that clients slowed threefold
	// still slow it down.
	FastServingFactor = 3
	// probeSettle is how long a paused migration lets the clients' requests that
	// met its last writes end before measuring them; probeInterval the least time
	// between two pauses of one migration (a pause that found the clients fast
	// without it keeps the floor, and pausing again at once would only stall it).
	probeSettle   = 200 * time.Millisecond
	probeInterval = 30 * time.Second
	// slowStartAgainFactor: a migration whose clients were calm in every window
	// since its last decrease and that now runs at this many times the rate that
	// decrease started from doubles again per calm window (slow start) until the next
	// congestion.
	slowStartAgainFactor = 2
	// busyFraction: a calm window raises the rate only when the migration used at
	// least this fraction of it; otherwise the rate was not what held it back, and
	// raising it would only let it drift far above what etcd was ever shown.
	busyFraction = 0.8
	// settleTolerance: a window that achieved at most this much above the rate a
	// decrease set kept to it (see settling).
	settleTolerance = 0.1
	// maxBlindDoubles is how many times in a row slow start doubles in windows whose
	// clients' requests wait for a judgement: one, so that the rate is at most four
	// times the last one judged (an apiserver judged every other window rises as fast
	// as one judged every window).
	maxBlindDoubles = 1
	// kneeFraction, minKneeCongestions and kneeMemory: once the latency of etcd or
	// of the clients has halved the rate at least minKneeCongestions times within
	// kneeMemory, the rate stops rising at kneeFraction of the knee (the median of
	// the rates those decreases started from) instead of climbing back over it.
	// Each climb over the knee costs the clients the seconds it takes to notice: a
	// 300,000-Secret migration under 30 requests/s climbed back within 3–5 s after
	// every halving, over a knee its ten decreases put at 4,300–6,700 objects/s,
	// and 8% of the clients' requests during it were over 1.5 × their p99 before (a
	// p99 lets 1% through). One decrease alone sets no knee: it may be a hiccup (see
	// transient in judge). The memory is five minutes (the span of Kubernetes' own
	// API latency SLO), not the horizon's one: one climb over the knee cost that
	// migration's clients 20–50 slow requests, more than the 18 a minute of 30
	// requests/s lets through, and with a minute's memory it climbed again every
	// minute.
	kneeFraction       = 0.85
	minKneeCongestions = 2
	kneeMemory         = 5 * time.Minute
	// DefaultServingHorizon is the span over which the normal and fast priorities keep
	// the clients' p99 within target (Options.ServingHorizon): a minute, the shortest
	// span over which an apiserver's request latency is usually watched (a
	// Prometheus rate window; Kubernetes' own API latency SLO takes five minutes).
	// Judging every second's p99 on its own made a 10,000-Secret rotation's
	// migration crawl from one slowed second to the next: eight rekey-only runs, in
	// which the migrations held every second took 11–25 s and left the rotation's
	// sampler p99 at ×1.27–1.96 of before (median ×1.83), those whose clients were not
	// judged at all 7–9.5 s at ×1.17–1.57 (median ×1.31). A slowdown spread thin is
	// still a slowdown: the clients count the slow requests, not the seconds.
	DefaultServingHorizon = time.Minute
	// horizonSpend is the share of the horizon's exceedances (servingExceedance of
	// its requests) that slowed windows may use before the rate decreases for them:
	// the rest is the margin for a window's delay in noticing, for the requests before
	// the migration (taken as within target) and for a horizon that slides onto a
	// slowdown it cannot undo.
	horizonSpend = 0.5
)

// Options tune the pacer. The zero value is the defaults.
type Options struct {
	// Ceiling is the most objects per second ever allowed (--storage-migration-rate);
	// 0 is no ceiling.
	Ceiling float64
	// TargetLatency is the p90 transaction latency above which the rate decreases. 0:
	// DefaultBaselineFactor × the first window's p90, at least DefaultMinTargetLatency.
	TargetLatency time.Duration
	// Window, MinRate, Increase, Decrease: see the defaults.
	Window   time.Duration
	MinRate  float64
	Increase float64
	Decrease float64
	// Serving, when set, is the apiserver's own request latency (an apiserver sets
	// it; `rekey migrate` runs outside one and has none). With enough recent requests
	// before the migration for a baseline, the migration starts at ServingStartRate and
	// slows down whenever the clients are answered more than ServingFactor times slower.
	Serving *ServingLatency
	// Members, when set, brings the other apiservers' clients to the pacer: a
	// cluster migration's leader sets it (pkg/cluster: the members' reports), so
	// that the watch caches the migration's writes load everywhere slow it down, not
	// only this apiserver's. Each member's classes are judged against that member's
	// own baseline, as this apiserver's are.
	Members MembersServing
	// ServingFactor and ServingStartRate: see the defaults; an unset ServingFactor
	// is the Priority's.
	ServingFactor    float64
	ServingStartRate float64
	// WatchCache, when set, is how far the apiserver's watch caches have got (an
	// apiserver sets it): a window in which the cache of the resource being migrated
	// was more than MaxWatchLag behind the migration's own writes is congestion, idle
	// cluster or not.
	WatchCache WatchCacheRevision
	// MaxWatchLag: DefaultMaxWatchLag when 0.
	MaxWatchLag time.Duration
	// ResumeRate is the rate a migration of the same rotation ended at a moment ago
	// (its Result.AllowedRate; the cluster migrator runs one resource after another).
	// With a serving baseline the rate starts there and grows additively, without slow
	// start: the migration before already found what the clients bear, and starting
	// every resource over at ServingStartRate costs each a second or more. 0 or +Inf:
	// ServingStartRate and slow start.
	ResumeRate float64
	// KnownRate is a rate the clients were answered within target at in an earlier
	// migration of this cluster (its Result.SustainedRate; the cluster migrator keeps
	// the latest in etcd). With a serving baseline and no ResumeRate, the rate starts at
	// half of it (Priority's KnownRateFraction: none of it for gentle, all of it for
	// fast), when that is above ServingStartRate, and doubles from there: the
	// cluster showed what its clients bear, and finding it again from ServingStartRate
	// costs a 1,000-object migration most of its time. The first window that shows
	// the clients slowed halves it as any.
	KnownRate float64
	// ServingHorizon is the span over which the clients' p99 is kept within target: a
	// window in which they were slowed decreases the rate only once the slow requests
	// of the last ServingHorizon (the windows judged in it, and the time before the
	// migration, counted at the clients' rate with none slow) are more than
	// horizonSpend of what a p99 within target lets through. A slowed window within
	// that ends slow start and holds the rate ("tolerate"). 0: the Priority's; below
	// 0: none, every window is judged on its own.
	ServingHorizon time.Duration
	// ResumeHorizon is what the migration before this one, of the same rotation,
	// judged of the clients within the horizon (Writer.ClientsHorizon): their
	// allowance of slow requests goes on from what that one left, instead of starting
	// over with a minute of its own. The zero value is none.
	ResumeHorizon ClientsHorizon
	// Priority trades the clients' latency for the migration's speed: the
	// ServingFactor when that is not set, where a migration with a serving baseline
	// starts, and the ServingHorizon (see Priority). "": PriorityNormal.
	Priority Priority
}

// Priority is how a migration weighs the apiserver's clients against its own speed
// (--storage-migration-priority).
type Priority string

// Priorities.
const (
	// PriorityGentle: clients within DefaultServingFactor in every window, and every
	// migration starts at ServingStartRate in slow start, whatever an earlier one
	// sustained.
	PriorityGentle Priority = "gentle"
	// PriorityNormal (the default): clients within DefaultServingFactor over
	// DefaultServingHorizon; a migration starts at half of Options.KnownRate when that
	// is above ServingStartRate.
	PriorityNormal Priority = "normal"
	// PriorityFast: clients within FastServingFactor over DefaultServingHorizon; a
	// migration starts at Options.KnownRate itself.
	PriorityFast Priority = "fast"
)

// Priorities lists the priorities, gentlest first.
func Priorities() []Priority { return []Priority{PriorityGentle, PriorityNormal, PriorityFast} }

// ParsePriority reads a priority's name ("" is PriorityNormal).
func ParsePriority(s string) (Priority, error) {
	if s == "" {
		return PriorityNormal, nil
	}
	for _, p := range Priorities() {
		if string(p) == s {
			return p, nil
		}
	}
	return "", fmt.Errorf("unknown storage migration priority %q: use %s, %s or %s", s, PriorityGentle, PriorityNormal, PriorityFast)
}

// ServingFactor is the clients' latency factor of the priority.
func (p Priority) ServingFactor() float64 {
	if p == PriorityFast {
		return FastServingFactor
	}
	return DefaultServingFactor
}

// ServingHorizon is the span over which the priority keeps the clients' p99 within
// target (Options.ServingHorizon): none for gentle (every window on its own),
// DefaultServingHorizon otherwise.
func (p Priority) ServingHorizon() time.Duration {
	if p == PriorityGentle {
		return -1
	}
	return DefaultServingHorizon
}

// KnownRateFraction is the fraction of Options.KnownRate a migration of the priority
// starts at (when above ServingStartRate): 0 for gentle (never), 0.5 for normal (the
// clients of now may be busier than those of the migration that found it), 1 for fast.
func (p Priority) KnownRateFraction() float64 {
	switch p {
	case PriorityGentle:
		return 0
	case PriorityFast:
		return 1
	}
	return 0.5
}

func (o Options) withDefaults() Options {
	if o.Window <= 0 {
		o.Window = DefaultPacingWindow
	}
	if o.MinRate <= 0 {
		o.MinRate = DefaultMinRate
	}
	if o.Ceiling > 0 {
		o.MinRate = min(o.MinRate, o.Ceiling)
	}
	if o.Increase <= 0 {
		o.Increase = DefaultIncrease
	}
	if o.Decrease <= 0 || o.Decrease >= 1 {
		o.Decrease = DefaultDecrease
	}
	if o.Priority == "" {
		o.Priority = PriorityNormal
	}
	if o.ServingFactor <= 1 {
		o.ServingFactor = o.Priority.ServingFactor()
	}
	if o.ServingHorizon == 0 {
		o.ServingHorizon = o.Priority.ServingHorizon()
	}
	if o.ServingStartRate <= 0 {
		o.ServingStartRate = DefaultServingStartRate
	}
	if o.MaxWatchLag <= 0 {
		o.MaxWatchLag = DefaultMaxWatchLag
	}
	return o
}

// pacer is the pacing decision, in etcd raft's shape: it never reads a clock, sleeps
// or does I/O. The driver feeds it every transaction's latency and outcome with the
// time it ended (Observe); Rate is the objects per second allowed now (+Inf: no limit).
//
// It starts at the ceiling (no limit without one): a migration of a quiet etcd runs as
// fast as before. At the end of each window, a p90 above the target or an etcd error
// in the window multiplies the rate by Decrease (starting from what the window really
// achieved when that is lower, so "no limit" becomes a number), never below MinRate;
// a calm window in which the migration used most of its rate adds Increase or a tenth
// of the rate, whichever is more, never above the ceiling.
//
// With a serving baseline (SetServingBaseline: the apiserver's clients' requests of a
// RequestClass were answered in p99 B before the migration), a window in which that
// class's p99 is above max(ServingFactor × B, B + 1ms) is congestion too; each class
// is judged against its own baseline only. The rate then starts at
// ServingStartRate and doubles per calm window until the first congestion (TCP's slow
// start): starting at full speed would slow every client for the windows it takes to
// halve down, and those seconds alone make a p99.
type pacer struct {
	opts Options
	rate float64
	// target is opts.TargetLatency or the baseline's; 0 until the first judged window.
	target time.Duration

	// pops are the clients' populations, each judged against its own target: this
	// apiserver's request classes first (pops[c] is class c), then those of the
	// other apiservers' clients as their reports arrive (ObserveMember). serving says
	// whether any population has a target (a serving baseline). slowStart: doubling
	// until the first congestion.
	pops      []population
	serving   bool
	slowStart bool
	// calmRate is the highest rate achieved in a window whose clients were judged
	// within target.
	calmRate float64
	// congestedRate is the rate the last decrease started from (0: none yet);
	// decreases counts them.
	congestedRate float64
	decreases     int
	// toleratedRate is the rate of the first window that ended slow start by
	// tolerating its clients' slowdown (0: none); tolerations counts those windows.
	toleratedRate float64
	tolerations   int
	// congestions are the decreases for latency (etcd's, the clients', the watch
	// cache's) of the last kneeMemory: when, and the rate each started from (see
	// knee). A decrease before the rate rose again is the same congestion, and is not
	// one more: the clients answered while the writes of the rate before were in
	// flight are still slow a window later, and that second halving's rate (half the
	// first's) made a knee of 862 objects/s in a 10,000-Secret rotation whose clients
	// were within target at 1,600/s. heldSinceDecrease: the rate has not risen since
	// the last decrease.
	congestions       []congestion
	heldSinceDecrease bool
	// clientsSlowed: in the latest window whose clients were judged, some class was
	// slowed (the verifying re-scan starts paced only then: see Writer.ReadPacer).
	clientsSlowed bool
	// blindDoubles counts slow start's doublings in a row in windows whose clients were
	// not judged (they wait for enough requests).
	blindDoubles int
	// canProbe: the pacer may pause (a Writer's; its driver calls tickProbe while
	// Probing). probing: paused to measure the clients of probeClasses without the
	// migration, from probeFrom; lastProbe: when the last pause ended.
	canProbe  bool
	probing   bool
	probeFrom time.Time
	probePops []int
	lastProbe time.Time

	windowStart time.Time
	latencies   []time.Duration
	// watchLag is the longest the watch cache was behind in this window; watchLagSeen
	// whether it was read at all.
	watchLag     time.Duration
	watchLagSeen bool
	objects      int64
	errors       int
	// last is the latest judgement, for the status and the transcripts; verdicts
	// counts them (a driver tells a new one from the one it saw before).
	last     pacerVerdict
	verdicts int
	// slowedBy says what made the last decrease, until the rate is back at the
	// ceiling (or unlimited).
	slowedBy string
}

// congestion is a decrease for latency: at when, from rate.
type congestion struct {
	at   time.Time
	rate float64
}

// population is one class of the requests of one apiserver's clients: member "" is
// this apiserver's own, another is a member's ID (its reports: see MembersServing).
type population struct {
	member string
	class  RequestClass
	servingClass
}

// name is the population as the logs say it: "get", or "get at apiserver-2".
func (pop population) name() string {
	if pop.member == "" {
		return pop.class.String()
	}
	return fmt.Sprintf("%s at %s", pop.class, pop.member)
}

// servingClass is the pacer's view of one population of the clients' requests.
type servingClass struct {
	// target is the class's p99 above which the rate decreases; 0: the class had
	// too few requests before the migration for a baseline, and its requests are not
	// judged. first is the target the migration started with (the bound of a
	// re-baseline).
	target, first time.Duration
	// pending are its requests waiting for a judgement; windows counts the windows
	// since it was last judged.
	pending []time.Duration
	windows int
	// externalP99s are its p99 of the windows in a row in which it was slow while
	// the migration achieved at most externalRateFraction of calmRate.
	externalP99s []time.Duration
	// horizon are its judged windows of the last Options.ServingHorizon, oldest
	// first.
	horizon []judgedWindow
}

// judgedWindow is what one window's judgement of a population counted: n requests
// answered from from to at, over of them above the target.
type judgedWindow struct {
	from, at time.Time
	n, over  int
}

// ClientsHorizon is what a migration's pacer judged of the clients within its
// horizon: each population's judged windows. A rotation migrates its resources one
// after another; each hands it to the next (Options.ResumeHorizon), so that twenty
// resources in a minute share one minute's allowance of slow requests instead of
// each spending half of a fresh one. The zero value is none.
type ClientsHorizon struct {
	pops []populationHorizon
}

type populationHorizon struct {
	member  string
	class   RequestClass
	windows []judgedWindow
}

// clientsHorizon is a copy of the pacer's horizon.
func (p *pacer) clientsHorizon() ClientsHorizon {
	var h ClientsHorizon
	if p.opts.ServingHorizon <= 0 {
		return h
	}
	for _, pop := range p.pops {
		if len(pop.horizon) > 0 {
			h.pops = append(h.pops, populationHorizon{member: pop.member, class: pop.class, windows: slices.Clone(pop.horizon)})
		}
	}
	return h
}

// resumeHorizon takes over a horizon handed on (Options.ResumeHorizon).
func (p *pacer) resumeHorizon(h ClientsHorizon) {
	if p.opts.ServingHorizon <= 0 {
		return
	}
	for _, ph := range h.pops {
		i := p.population(ph.member, ph.class)
		p.pops[i].horizon = slices.Clone(ph.windows)
	}
}

// classVerdict is one class's judgement in a window; Samples 0: not judged. Over
// counts the requests above the class's target; Slowed says they are too many for a
// p99 within target (significantlyOver).
type classVerdict struct {
	P99     time.Duration
	Samples int
	Over    int
	Slowed  bool
}

// pacerVerdict is what the pacer concluded at the end of a window.
type pacerVerdict struct {
	At       time.Time
	P90      time.Duration
	Samples  int
	Errors   int
	Achieved float64 // objects per second in the window
	// ServingP99 of ServingSamples client requests of ServingClass (at
	// ServingMember; "": this apiserver's), whose target is ServingTarget, when a
	// population had enough to judge: of those judged, the one furthest above its
	// target (or closest to it). Classes holds every population's judgement, indexed
	// as pacer.pops (this apiserver's class c at c).
	ServingP99     time.Duration
	ServingSamples int
	ServingClass   RequestClass
	ServingMember  string
	ServingTarget  time.Duration
	Classes        []classVerdict
	// WatchLag is how far behind the watch cache was at most (when it was read).
	WatchLag     time.Duration
	WatchLagSeen bool
	// Change is "baseline" (the first window, which sets etcd's latency target; in
	// slow start "baseline, double" when it is calm), "decrease", "increase",
	// "double", "recover" (halfway back to the rate of the last decrease), "hold",
	// "settle" (clients recovering from the decrease just before: see settling),
	// "rebaseline", "probe" (paused to measure the clients), "probed" (the pause's
	// measurement) or "tolerate" (clients slowed within the horizon's allowance: see
	// Options.ServingHorizon); an increase stopped at the knee of the rates that
	// congested (kneeFraction) says so, as "recover at knee" or "hold at knee".
	Change string
	// Cause of a decrease: "etcd errors", "etcd latency", "serving latency" or "watch
	// cache lag".
	Cause string
}

func newPacer(opts Options) *pacer {
	opts = opts.withDefaults()
	p := &pacer{opts: opts, rate: math.Inf(1), target: opts.TargetLatency}
	for c := range RequestClass(numRequestClasses) {
		p.pops = append(p.pops, population{class: c})
	}
	if opts.Ceiling > 0 {
		p.rate = opts.Ceiling
	}
	p.resumeHorizon(opts.ResumeHorizon)
	return p
}

// Rate is the objects per second allowed now; +Inf is no limit.
func (p *pacer) Rate() float64 { return p.rate }

// Target is the latency target, 0 before the baseline is known.
func (p *pacer) Target() time.Duration { return p.target }

// LatencyScale is what a transaction's latency is judged against: the target, or
// before the first window is judged, what the target would be from the transactions
// seen so far (0 when none was).
func (p *pacer) LatencyScale() time.Duration {
	if p.target > 0 || len(p.latencies) == 0 {
		return p.target
	}
	return max(time.Duration(DefaultBaselineFactor)*slices.Max(p.latencies), DefaultMinTargetLatency)
}

// SlowedBy is why the rate is below where it started: the last decrease's cause and
// figures; "" when it is not.
func (p *pacer) SlowedBy() string { return p.slowedBy }

// SetServingBaseline makes the clients' latency a signal: b holds each class's p99
// before the migration (0: none; with none at all this does nothing). Called before
// the first transaction.
func (p *pacer) SetServingBaseline(b servingBaselines) {
	if !b.any() {
		return
	}
	for c, base := range b {
		if base > 0 {
			t := p.servingTargetOf(base)
			p.pops[c].target, p.pops[c].first = t, t
		}
	}
	p.serving = true
	if r := p.opts.ResumeRate; r > 0 && !math.IsInf(r, 1) {
		p.rate = min(p.rate, max(r, p.opts.MinRate))
		return
	}
	p.slowStart = true
	start := p.opts.ServingStartRate
	if k := p.opts.KnownRate; k > 0 && !math.IsInf(k, 1) {
		start = max(start, p.opts.Priority.KnownRateFraction()*k)
	}
	p.rate = min(p.rate, start)
}

// inheritServingTargets takes the clients' targets from another pacer of the same
// migration: a target it re-measured (rebaseline) holds for this one too, the other
// apiservers' included, and so do the windows it judged within the horizon (what the
// clients paid for the writes counts against the re-scan's allowance as well).
func (p *pacer) inheritServingTargets(from *pacer) {
	for _, f := range from.pops {
		if f.target > 0 {
			i := p.population(f.member, f.class)
			p.pops[i].target, p.pops[i].first = f.target, f.first
			p.pops[i].horizon = slices.Clone(f.horizon)
			p.serving = true
		}
	}
}

// population is the index of member's class c in pops, added (without a target)
// when it is new.
func (p *pacer) population(member string, c RequestClass) int {
	if member == "" {
		return int(c)
	}
	for i, pop := range p.pops {
		if pop.member == member && pop.class == c {
			return i
		}
	}
	p.pops = append(p.pops, population{member: member, class: c})
	return len(p.pops) - 1
}

// ObserveMember feeds requests of class c answered by another apiserver (member)
// during the migration, whose p99 before it was baseline (0: too few requests for
// one; they are not judged). The first report of a class with a baseline sets its
// target, as SetServingBaseline does for this apiserver's: each apiserver's clients
// are judged against their own past, never another's.
func (p *pacer) ObserveMember(member string, c RequestClass, baseline time.Duration, latencies []time.Duration) {
	if c >= numRequestClasses || member == "" {
		return
	}
	i := p.population(member, c)
	pop := &p.pops[i]
	if pop.target == 0 {
		if baseline <= 0 {
			return
		}
		pop.target = p.servingTargetOf(baseline)
		pop.first = pop.target
		p.serving = true
	}
	for _, d := range latencies {
		if len(pop.pending) >= maxPendingServing {
			break
		}
		pop.pending = append(pop.pending, d)
	}
}

// ClientsOf are the apiservers whose clients the pacer judges (some class of theirs
// has a target): "" is this apiserver, first when it is one of them, then the
// members in the order their reports came.
func (p *pacer) ClientsOf() []string {
	var out []string
	for _, pop := range p.pops {
		if pop.target > 0 && !slices.Contains(out, pop.member) {
			out = append(out, pop.member)
		}
	}
	return out
}

// SustainedRate is the highest rate achieved in a window whose clients were judged
// and answered within target (0: none was): evidence of what they bear, for the next
// migration's start (Options.KnownRate).
func (p *pacer) SustainedRate() float64 { return p.calmRate }

func (p *pacer) servingTargetOf(baseline time.Duration) time.Duration {
	return max(time.Duration(p.opts.ServingFactor*float64(baseline)), baseline+minServingSlack)
}

// ServingTarget is the latency target of this apiserver's clients' requests of
// class c; 0 when the class had no baseline.
func (p *pacer) ServingTarget(c RequestClass) time.Duration { return p.pops[c].target }

// servingTargets names every population's target, for the logs.
func (p *pacer) servingTargets() string {
	var parts []string
	for _, pop := range p.pops {
		if pop.target > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", pop.name(), pop.target))
		}
	}
	return strings.Join(parts, ", ")
}

// ObserveWatchLag feeds how far the apiserver's watch cache was behind the
// migration's own writes.
func (p *pacer) ObserveWatchLag(lag time.Duration) {
	p.watchLag, p.watchLagSeen = max(p.watchLag, lag), true
}

// ObserveServing feeds one client request of class c answered during the
// migration. A class without a baseline is not judged.
func (p *pacer) ObserveServing(c RequestClass, latency time.Duration) {
	if c >= numRequestClasses {
		return
	}
	if cl := &p.pops[c]; cl.target > 0 && len(cl.pending) < maxPendingServing {
		cl.pending = append(cl.pending, latency)
	}
}

// pendingServing is how many client requests wait for a judgement.
func (p *pacer) pendingServing() (n int) {
	for _, cl := range p.pops {
		n += len(cl.pending)
	}
	return n
}

// pendingLeansSlowed reports whether the client requests waiting for a judgement
// already lean towards a slowdown: in some class, more than one above its target, or
// enough to be evidence of it (significantlyOver). One alone is what clients whose
// p99 is within target show: of 60 requests, 45% of windows hold at least one slower
// than the p99 of clients exactly at target, and holding on it cost slow start a window
// each time.
func (p *pacer) pendingLeansSlowed() bool {
	judged := p.judgedPopulations()
	for _, cl := range p.pops {
		if over := countOver(cl.pending, cl.target); over > 1 || significantlyOverAmong(over, len(cl.pending), judged) {
			return true
		}
	}
	return false
}

// dropServing forgets the client requests waiting for a judgement.
func (p *pacer) dropServing() {
	for i := range p.pops {
		p.pops[i].pending, p.pops[i].windows = p.pops[i].pending[:0], 0
	}
}

// Observe feeds one transaction that ended at now after latency, writing objects
// (counted whether or not it succeeded); err is its etcd error, if any. A conflict is
// not an error: the transaction was answered.
func (p *pacer) Observe(now time.Time, latency time.Duration, objects int, err error) {
	if p.windowStart.IsZero() {
		p.windowStart = now.Add(-latency)
	}
	p.latencies = append(p.latencies, latency)
	p.objects += int64(objects)
	if err != nil {
		p.errors++
	}
	p.Tick(now)
}

// Tick ends the window when it is over.
func (p *pacer) Tick(now time.Time) {
	if p.probing || p.windowStart.IsZero() || now.Sub(p.windowStart) < p.opts.Window {
		return
	}
	if len(p.latencies) < minSamples && p.errors == 0 {
		// Too few to judge (a slow rate): the window goes on until there are enough.
		return
	}
	elapsed := now.Sub(p.windowStart)
	v := pacerVerdict{At: now, Samples: len(p.latencies), Errors: p.errors, Achieved: float64(p.objects) / elapsed.Seconds()}
	v.P90 = quantile(p.latencies, pacingQuantile)
	p.judgeClasses(&v)
	v.WatchLag, v.WatchLagSeen = p.watchLag, p.watchLagSeen
	p.watchLag, p.watchLagSeen = 0, false
	v.Change, v.Cause = p.judge(v)
	p.setLast(v)
	p.windowStart, p.latencies, p.objects, p.errors = now, p.latencies[:0], 0, 0
}

// judgeClasses judges every class with enough requests waiting (or with some,
// after maxServingWindows windows: a light workload must not hold the rate for long;
// or with fewer that already show a slowdown) into v, and names in v.Serving* the
// class slowed furthest above its own target (or, when none is, the one closest to
// it).
func (p *pacer) judgeClasses(v *pacerVerdict) {
	worst, worstSlowed := math.Inf(-1), false
	v.Classes = make([]classVerdict, len(p.pops))
	judged := p.judgedPopulations()
	for c := range p.pops {
		cl := &p.pops[c]
		if cl.target == 0 {
			continue
		}
		cl.windows++
		n := len(cl.pending)
		if n == 0 {
			continue
		}
		over := countOver(cl.pending, cl.target)
		slowed := significantlyOverAmong(over, n, judged)
		if n < minServingSamples && cl.windows < maxServingWindows && !slowed {
			continue
		}
		p99 := quantile(cl.pending, servingQuantile)
		v.Classes[c] = classVerdict{P99: p99, Samples: n, Over: over, Slowed: slowed}
		p.remember(&cl.servingClass, p.windowStart, v.At, n, over)
		r := float64(p99) / float64(cl.target)
		if (slowed && !worstSlowed) || (slowed == worstSlowed && r > worst) {
			worst, worstSlowed = r, slowed
			v.setServing(*cl, p99, n)
		}
		cl.pending, cl.windows = cl.pending[:0], 0
	}
}

// remember adds a judged window of cl to its horizon and forgets the windows the
// horizon has left behind.
func (p *pacer) remember(cl *servingClass, from, at time.Time, n, over int) {
	if p.opts.ServingHorizon <= 0 {
		return
	}
	cl.horizon = append(cl.horizon, judgedWindow{from: from, at: at, n: n, over: over})
	i := 0
	for i < len(cl.horizon) && at.Sub(cl.horizon[i].at) >= p.opts.ServingHorizon {
		i++
	}
	cl.horizon = cl.horizon[i:]
}

// forgetHorizon empties cl's horizon when its target moves to a slowdown of the
// cluster's own (rebaseline, or a probe that found the clients slower without the
// migration): the slow requests in it were not the migration's, and were counted
// against a target cl no longer has; kept, they would make the horizon look spent and
// halve the rate for the first slowed window judged against the new target.
func (cl *servingClass) forgetHorizon() { cl.horizon = cl.horizon[:0] }

// horizonSpent is the share of its horizon's allowance of slow requests (a p99 within
// target lets servingExceedance of them through) that population c has used at now:
// its requests above target in the windows judged within the horizon, against the
// horizon's requests, those of the part before the first of those windows (before the
// migration, or its rotation's migration before) counted at the rate of those judged
// since, none of them slow. +Inf without a horizon (each window stands alone) or with
// nothing judged within it.
func (p *pacer) horizonSpent(c int, now time.Time) float64 {
	h := p.opts.ServingHorizon
	if h <= 0 {
		return math.Inf(1)
	}
	var n, over int
	var first time.Time
	for _, w := range p.pops[c].horizon {
		if now.Sub(w.at) < h {
			if first.IsZero() {
				first = w.from
			}
			n, over = n+w.n, over+w.over
		}
	}
	if n == 0 {
		return math.Inf(1)
	}
	covered := min(now.Sub(first), h)
	requests := float64(n)
	if covered > 0 && covered < h {
		requests *= float64(h) / float64(covered)
	}
	return float64(over) / (servingExceedance * requests)
}

// withinHorizon says whether every population judged slowed in v has used less than
// horizonSpend of its horizon's allowance (horizonSpent).
func (p *pacer) withinHorizon(v pacerVerdict) bool {
	over := p.overTarget(v)
	for _, c := range over {
		if p.horizonSpent(c, v.At) >= horizonSpend {
			return false
		}
	}
	return len(over) > 0
}

// setServing names pop, whose p99 of n requests was p99, as the verdict's clients.
func (v *pacerVerdict) setServing(pop population, p99 time.Duration, n int) {
	v.ServingP99, v.ServingSamples, v.ServingClass, v.ServingMember, v.ServingTarget = p99, n, pop.class, pop.member, pop.target
}

// servingName names the verdict's clients as the logs say them: "get requests",
// "get requests at apiserver-2".
func (v pacerVerdict) servingName() string {
	return population{member: v.ServingMember, class: v.ServingClass}.name() + " requests"
}

// setLast records v as the latest verdict.
func (p *pacer) setLast(v pacerVerdict) {
	p.last = v
	p.verdicts++
}

// countOver counts the latencies above target.
func countOver(ds []time.Duration, target time.Duration) (n int) {
	for _, d := range ds {
		if d > target {
			n++
		}
	}
	return n
}

// significantlyOver reports whether over of n requests above their target are too
// many for clients whose p99 is within it: were at most servingExceedance of them
// above it, as many or more would be seen with probability below
// servingSignificance. (Of 100 requests, 4 over is a slowdown and 3 is not; of 30,
// 2 is; of 10, 2 is.)
func significantlyOver(over, n int) bool { return significantlyOverAmong(over, n, 1) }

// significantlyOverAmong is significantlyOver for one of populations populations
// judged at once: each at servingSignificance / populations (Bonferroni), so that
// clients all within target make a window a slowdown with probability below
// servingSignificance, not below one minus (1 − servingSignificance)^populations.
func significantlyOverAmong(over, n, populations int) bool {
	return over > 0 && binomialUpperTail(n, over, servingExceedance) < servingSignificance/float64(max(populations, 1))
}

// judgedPopulations counts the populations this pacer judges (those with a target),
// among which a window's significance is shared (significantlyOverAmong). Three
// apiservers' reads and writes are six populations; tested at 5% each, a window whose
// clients were all exactly at target was a slowdown one time in four, and each halved
// the rate (a 10,000-Secret rotation on three apiservers spent 14–28 s at 150–800
// objects/s, halved by one apiserver's 50 reads at a time).
func (p *pacer) judgedPopulations() (n int) {
	for _, pop := range p.pops {
		if pop.target > 0 {
			n++
		}
	}
	return n
}

// binomialUpperTail is P(X ≥ k) for X ~ Binomial(n, q).
func binomialUpperTail(n, k int, q float64) float64 {
	if k <= 0 {
		return 1
	}
	if k > n {
		return 0
	}
	// 1 − P(X < k), the terms built one from the other: P(X=i+1) = P(X=i) ·
	// (n−i)/(i+1) · q/(1−q).
	term := math.Pow(1-q, float64(n))
	below := 0.0
	for i := 0; i < k; i++ {
		below += term
		term *= float64(n-i) / float64(i+1) * q / (1 - q)
	}
	return max(1-below, 0)
}

// overTarget are the populations judged in v slowed beyond their target (indexes
// of pops).
func (p *pacer) overTarget(v pacerVerdict) []int {
	var over []int
	for c, cv := range v.Classes {
		if cv.Samples > 0 && cv.Slowed {
			over = append(over, c)
		}
	}
	return over
}

// resetExternal forgets the slow windows in a row of the populations judged in v.
func (p *pacer) resetExternal(v pacerVerdict) {
	for c, cv := range v.Classes {
		if cv.Samples > 0 {
			p.pops[c].externalP99s = p.pops[c].externalP99s[:0]
		}
	}
}

func (p *pacer) judge(v pacerVerdict) (change, cause string) {
	baseline := false
	if p.target == 0 && v.Errors == 0 {
		p.target = max(time.Duration(DefaultBaselineFactor)*v.P90, DefaultMinTargetLatency)
		baseline = true
	}
	if v.ServingSamples > 0 {
		p.clientsSlowed = len(p.overTarget(v)) > 0
	}
	switch {
	case v.Errors > 0:
		cause = "etcd errors"
	case !baseline && v.P90 > p.target:
		cause = "etcd latency"
	case len(p.overTarget(v)) > 0:
		if p.slowerByItself(v) {
			return p.rebaseline(v)
		}
		if p.canProbe && p.atFloor() && (p.lastProbe.IsZero() || v.At.Sub(p.lastProbe) >= probeInterval) {
			return p.startProbe(v)
		}
		if p.settling(v) {
			return "settle", ""
		}
		if p.withinHorizon(v) {
			// Slowed, but the clients' p99 over the horizon is still well within
			// target: the rate holds, and slow start ends (the next doubling would
			// slow them further; a decrease would stretch the slowdown over more
			// seconds, which the clients pay for too).
			if p.slowStart {
				p.toleratedRate = min(p.rate, v.Achieved)
			}
			p.tolerations++
			p.slowStart = false
			return "tolerate", ""
		}
		cause = "serving latency"
	case v.WatchLag > p.opts.MaxWatchLag:
		cause = "watch cache lag"
	}
	if v.ServingSamples > 0 && cause != "serving latency" {
		p.resetExternal(v)
		if cause == "" {
			p.calmRate = max(p.calmRate, v.Achieved)
		}
	}
	if cause != "" {
		p.congestedRate = min(p.rate, v.Achieved)
		if cause != "etcd errors" {
			if !p.heldSinceDecrease {
				p.congestions = append(p.congestions, congestion{at: v.At, rate: p.congestedRate})
			}
			p.heldSinceDecrease = true
		}
		p.rate = max(p.congestedRate*p.opts.Decrease, p.opts.MinRate)
		p.decreases++
		p.slowStart = false
		switch cause {
		case "etcd errors":
			p.slowedBy = fmt.Sprintf("etcd errors (%d of %d transactions)", v.Errors, v.Samples)
		case "etcd latency":
			p.slowedBy = fmt.Sprintf("etcd latency (p90 %s, target %s)", v.P90, p.target)
		case "watch cache lag":
			p.slowedBy = fmt.Sprintf("the apiserver's watch cache fell behind the migration's writes (%s, at most %s)", v.WatchLag.Round(time.Millisecond), p.opts.MaxWatchLag)
		default:
			p.slowedBy = fmt.Sprintf("the apiserver's clients answered slower (%s: p99 %s, target %s)", v.servingName(), v.ServingP99, v.ServingTarget)
		}
		return "decrease", cause
	}
	hold := "hold"
	if baseline {
		// The first window sets etcd's latency target. In slow start it raises the
		// rate too when it is calm, as any window: a second at ServingStartRate only
		// to learn etcd's latency was a tenth of a 10,000-Secret rotation's migrate
		// stage.
		if !p.slowStart {
			return "baseline", ""
		}
		hold = "baseline"
	}
	unjudged := p.serving && v.ServingSamples == 0 && p.pendingServing() > 0
	if unjudged && (p.clientsSlowed || p.pendingLeansSlowed()) {
		// The clients' requests of this window wait for enough others to be judged,
		// and either they were slowed when last judged (a tolerated or a decreasing
		// window) or these already lean towards a slowdown: until the judgement there
		// is no evidence that more is harmless. Otherwise the rate may rise. (An
		// apiserver that sees 60 requests of a class per second was judged every
		// other window and rose half as fast; the judgement, when it comes, decides as
		// before. With no clients at all, etcd alone decides.) Rising on the windows
		// after a slowed judgement, a 300,000-Secret migration went from a tolerated
		// 11,400 objects/s to 13,100/s and its clients from a p99 of 12ms to 56ms; of
		// its clients' requests over 1.5 × their p99 before, 67 of 118 came in those
		// 20 seconds.
		return hold, ""
	}
	if !unjudged {
		p.blindDoubles = 0
	}
	if p.slowStart && unjudged && p.blindDoubles >= maxBlindDoubles {
		// Slow start doubles once more while the clients' requests wait for a
		// judgement, not again: with a light workload (30 requests/s, judged every 3–5
		// windows) it doubled from the last judged 1,600 objects/s to 25,600 in three
		// windows, before any of its clients were judged at those rates, and a
		// 300,000-Secret migration achieved 11,172/s before etcd's latency halved it.
		return hold, ""
	}
	if math.IsInf(p.rate, 1) || v.Achieved < busyFraction*p.rate || (p.opts.Ceiling > 0 && p.rate >= p.opts.Ceiling) {
		return hold, ""
	}
	if baseline {
		defer func() { change = "baseline, " + change }()
	}
	// The migration's only congestion so far is behind it when a window achieved
	// its rate again with the clients judged within target: that window shows the
	// rate is not what slowed them (an etcd hiccup as every apiserver reloaded,
	// a burst of other work). Growing a tenth per window from there took a
	// 10,000-Secret rotation 9 windows from 300 to 665 objects/s after one window
	// whose etcd p90 was 35 ms at 400/s.
	transient := p.decreases == 1 && v.ServingSamples > 0 && v.Achieved >= busyFraction*p.congestedRate
	// So is a tolerated slowdown that ended slow start, the only one, once a window
	// achieved that rate again with the clients within target: a 300,000-Secret
	// migration's first window, at 100 objects/s as every apiserver reloaded, was
	// tolerated, and growing a tenth per window from there took it 40 windows to
	// reach 5,000/s.
	toleratedOnce := p.decreases == 0 && p.tolerations == 1 && p.toleratedRate > 0 &&
		v.ServingSamples > 0 && v.Achieved >= busyFraction*p.toleratedRate
	knee := p.knee(v.At)
	if !p.slowStart && p.serving && (toleratedOnce || p.congestedRate > 0 && (transient || p.rate >= slowStartAgainFactor*max(p.congestedRate, knee))) {
		// Or the migration now runs at twice the rate of the last congestion, every
		// window calm since: that congestion was not its doing either, and growing a
		// tenth per window from it took a 10,000-Secret rotation 20 s to reach 1,000
		// objects/s. Either way the congestions behind it set no knee.
		p.slowStart = true
		p.congestions, knee = p.congestions[:0], 0
	}
	change = "increase"
	before := p.rate
	switch {
	case p.slowStart:
		p.rate, change = 2*p.rate, "double"
		if unjudged {
			p.blindDoubles++
		}
	default:
		step := p.rate + max(p.opts.Increase, increaseFraction*p.rate)
		if back := p.rate + (p.congestedRate-p.rate)/2; back > step {
			// Halfway back to the rate the last decrease started from (a binary
			// search for what the clients bear, as BIC-TCP's increase): fast while far
			// below it, slower near it, never at it in one step. A tenth per window took
			// a 10,000-Secret rotation 9 s to climb back after one window of slow
			// start's overshoot (1,293 objects/s achieved, halved to 646).
			p.rate, change = back, "recover"
		} else {
			p.rate = step
		}
	}
	if knee > 0 && p.rate > kneeFraction*knee {
		if before < kneeFraction*knee {
			p.rate = kneeFraction * knee
		} else {
			p.rate, change = before, "hold"
		}
		change += " at knee"
	}
	if p.rate > before {
		p.heldSinceDecrease = false
	}
	if p.opts.Ceiling > 0 {
		p.rate = min(p.rate, p.opts.Ceiling)
		if p.rate >= p.opts.Ceiling {
			p.slowedBy = ""
		}
	}
	return change, ""
}

// knee is the rate around which the latency of etcd or of the clients has kept
// halving the rate: the median (the lower one of an even count) of the rates the
// congestions of the last kneeMemory started from, when there are at least
// minKneeCongestions of them and the apiserver has clients to protect; 0 otherwise.
// Without clients a climb over the knee costs only etcd latency, and the migration
// takes what etcd gives.
func (p *pacer) knee(now time.Time) float64 {
	i := 0
	for i < len(p.congestions) && now.Sub(p.congestions[i].at) >= kneeMemory {
		i++
	}
	p.congestions = p.congestions[i:]
	if !p.serving || len(p.congestions) < minKneeCongestions {
		return 0
	}
	rates := make([]float64, len(p.congestions))
	for i, c := range p.congestions {
		rates[i] = c.rate
	}
	slices.Sort(rates)
	return rates[(len(rates)-1)/2]
}

// settling reports whether a window whose clients were slowed shows them recovering
// from the decrease just before it: that decrease was for them, this window kept to the
// rate it set, and the slowest class is less far over its target than the one the
// decrease was for. Such a window judges requests answered in part while the writes at
// the rate before were still in flight or still being reported (a follower reports
// every clientsReportInterval); the rate holds and the next window judges the new one.
// Clients not recovering (slower, or as slow) are halved for again at once. Halving on
// every slowed window took a 10,000-Secret rotation from 783 to 196 objects/s in two
// windows, the second one's clients at 1.25× their target after 1.63× in the first.
func (p *pacer) settling(v pacerVerdict) bool {
	last := p.last
	return last.Change == "decrease" && last.Cause == "serving latency" && v.Achieved <= (1+settleTolerance)*p.rate &&
		severity(v) < severity(last)
}

// severity is how far the verdict's clients were from their target (p99 ÷ target; 0
// when none was judged).
func severity(v pacerVerdict) float64 {
	if v.ServingTarget <= 0 {
		return 0
	}
	return float64(v.ServingP99) / float64(v.ServingTarget)
}

// slowerByItself reports whether a window in which classes of the clients were slower
// than their targets shows the cluster slower by itself rather than slowed by the
// migration: the migration achieved at most externalRateFraction of a rate the clients
// were answered within target at, or it was held at its floor. Such windows hold the
// rate instead of halving it. Each slow class keeps its own p99s in a row; the classes
// judged within target start theirs over.
//
// The floor matters when the clients were never within target during the migration
// (a busy machine from the first window on): there is no calm rate to compare with,
// and without it the migration stayed at its floor to the end (200 objects took 44 s
// on a CI machine running four test groups on two cores).
func (p *pacer) slowerByItself(v pacerVerdict) bool {
	over := p.overTarget(v)
	external := (p.calmRate > 0 && v.Achieved <= externalRateFraction*p.calmRate) || p.atFloor()
	for _, c := range over {
		if p.servingTargetOf(v.Classes[c].P99) > maxRebaselineFactor*p.pops[c].first {
			external = false
		}
	}
	if !external {
		p.resetExternal(v)
		return false
	}
	for c, cv := range v.Classes {
		cl := &p.pops[c]
		switch {
		case cv.Samples == 0:
		case cv.Slowed:
			cl.externalP99s = append(cl.externalP99s, cv.P99)
		default:
			cl.externalP99s = cl.externalP99s[:0]
		}
	}
	return true
}

// rebaseline answers a window slower by itself: after externalWindows of them in a
// row, the clients' baseline becomes the fastest p99 those windows saw (what the
// cluster gives its clients now, with the migration at half a rate it bore before),
// within maxRebaselineFactor of the first target, and the rate goes back to the calm
// one; until then the rate holds. (slowerByItself keeps the new target within
// maxRebaselineFactor of the first.)
func (p *pacer) rebaseline(v pacerVerdict) (change, cause string) {
	over := p.overTarget(v)
	for _, c := range over {
		if len(p.pops[c].externalP99s) < externalWindows {
			return "hold", ""
		}
	}
	for _, c := range over {
		cl := &p.pops[c]
		cl.target = max(cl.target, p.servingTargetOf(slices.Min(cl.externalP99s)))
		cl.externalP99s = cl.externalP99s[:0]
		cl.forgetHorizon()
	}
	p.rate = max(p.rate, p.calmRate)
	if p.opts.Ceiling > 0 {
		p.rate = min(p.rate, p.opts.Ceiling)
	}
	p.congestions = p.congestions[:0] // as in tickProbe: the cluster's slowdown, not a knee
	shown := fmt.Sprintf("within target at %.0f/s", p.calmRate)
	if p.calmRate == 0 {
		shown = fmt.Sprintf("at the floor of %.0f/s", p.opts.MinRate)
	}
	p.slowedBy = fmt.Sprintf("the apiserver's clients are slower whatever the migration does (%s: p99 %s at %.0f objects/s, %s): their targets are now %s",
		v.servingName(), v.ServingP99, v.Achieved, shown, p.servingTargets())
	return "rebaseline", ""
}

// startProbe answers a window whose clients are slowed while the migration is held at
// its floor, beyond what a re-baseline may accept (maxRebaselineFactor × the first
// target): the migration takes the least it can and they are still far slower than
// before it, so whether it is what slows them is measured instead of guessed. It
// pauses (Probing) while its driver feeds the clients' requests and calls tickProbe.
// Without it such a migration stayed at its floor to the end: on a CI machine running
// four test groups, 3,000 Secrets took 4 minutes at 12 objects/s while the clients
// were ×4.95 slower than their baseline for reasons of their own.
func (p *pacer) startProbe(v pacerVerdict) (change, cause string) {
	p.probing, p.probeFrom, p.probePops = true, v.At.Add(probeSettle), p.overTarget(v)
	p.dropServing()
	p.slowedBy = fmt.Sprintf("paused to measure the apiserver's clients without the migration (%s: p99 %s at its floor of %.0f objects/s, target %s)",
		v.servingName(), v.ServingP99, p.opts.MinRate, v.ServingTarget)
	return "probe", ""
}

// Probing says whether the migration is paused to measure its clients without it.
func (p *pacer) Probing() bool { return p.probing }

// tickProbe measures the clients while the migration is paused: from probeFrom (the
// requests answered before it met the migration's last writes) until each class it
// measures has minServingSamples, or for maxServingWindows windows at most. A class
// still slowed then is slowed by something else: its target becomes ServingFactor ×
// what it gets now, whatever the first target was (the figure was taken without the
// migration). A class within its target without the migration keeps its target, and
// the migration its floor. Either way the migration writes again, and does not pause
// again for probeInterval.
func (p *pacer) tickProbe(now time.Time) {
	if !p.probing {
		return
	}
	if now.Before(p.probeFrom) {
		p.dropServing()
		return
	}
	elapsed := now.Sub(p.probeFrom)
	enough := elapsed >= p.opts.Window
	for _, c := range p.probePops {
		enough = enough && len(p.pops[c].pending) >= minServingSamples
	}
	if !enough && elapsed < maxServingWindows*p.opts.Window {
		return
	}
	v := pacerVerdict{At: now, Change: "probed", Classes: make([]classVerdict, len(p.pops))}
	var moved []string
	judged := p.judgedPopulations()
	for _, c := range p.probePops {
		cl := &p.pops[c]
		n := len(cl.pending)
		if n == 0 {
			continue
		}
		over := countOver(cl.pending, cl.target)
		p99 := quantile(cl.pending, servingQuantile)
		slowed := significantlyOverAmong(over, n, judged)
		v.Classes[c] = classVerdict{P99: p99, Samples: n, Over: over, Slowed: slowed}
		p.remember(&cl.servingClass, p.probeFrom, now, n, over)
		if v.ServingSamples == 0 || slowed {
			v.setServing(*cl, p99, n)
		}
		if slowed {
			cl.target = max(cl.target, p.servingTargetOf(p99))
			cl.forgetHorizon()
			moved = append(moved, fmt.Sprintf("%s p99 %s", cl.name(), p99))
		}
		cl.externalP99s = cl.externalP99s[:0]
	}
	if len(moved) > 0 {
		// The halvings that led here were for a slowdown of the cluster's own:
		// they say nothing of what the migration may take.
		p.congestions = p.congestions[:0]
		p.slowedBy = fmt.Sprintf("the apiserver's clients are slower without the migration too (paused: %s): their targets are now %s",
			strings.Join(moved, ", "), p.servingTargets())
	} else {
		p.slowedBy = fmt.Sprintf("the apiserver's clients are within target without the migration and slower with it at its floor of %.0f objects/s", p.opts.MinRate)
	}
	p.dropServing()
	p.probing, p.lastProbe = false, now
	p.setLast(v)
	p.windowStart, p.latencies, p.objects, p.errors = now, p.latencies[:0], 0, 0
}

// atFloor says whether the rate is held at MinRate: no decrease can take less.
func (p *pacer) atFloor() bool { return p.rate <= p.opts.MinRate }

// quantile is the q-quantile of ds (nearest rank); ds is reordered.
func quantile(ds []time.Duration, q float64) time.Duration {
	if len(ds) == 0 {
		return 0
	}
	slices.Sort(ds)
	i := int(math.Ceil(q*float64(len(ds)))) - 1
	return ds[min(max(i, 0), len(ds)-1)]
}
