package pace

// The driver of the pacer and the space gate: every etcd transaction of a migration
// goes through Writer.Txn, which waits for room in etcd and for the pacer's rate,
// times the transaction and feeds the outcome back.

import (
	"context"
	"errors"
	"fmt"
	"math"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/time/rate"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/etcdunavailable"
)

// spaceReadGrace is how long the other members may take once one answered.
const spaceReadGrace = 250 * time.Millisecond

// batchSpread: a transaction carries at most this long's worth of the allowed rate.
const batchSpread = 50 * time.Millisecond

// PauseState is why a migration does not write now.
type PauseState struct {
	// Reason is one of PauseDBSize, PauseNoSpace, PauseUnknown; "" when not paused.
	Reason string `json:"reason,omitempty"`
	// Condition says what holds it and what frees it.
	Condition string    `json:"condition,omitempty"`
	Since     time.Time `json:"since,omitzero"`
}

// WriterOptions configure a Writer.
type WriterOptions struct {
	Client *clientv3.Client
	// Clock times the transactions and paces them (nil: the real clock).
	Clock  clock.Clock
	Logger klog.Logger
	// Pacing tunes the adaptive rate; its Ceiling is the most objects per second.
	Pacing Options
	Space  SpaceOptions
	// MaxBatch is the most objects one transaction carries.
	MaxBatch int
	// RecordRate and RecordPause, when set, are told (with the writer's lock held,
	// so in order) the rate allowed after every transaction and the pause reason
	// whenever it changes: pkg/migrate's metrics.
	RecordRate  func(objectsPerSecond float64)
	RecordPause func(reason string)
	// PauseChanged, when set, is called without the lock when the pause state
	// changes: the caller's status may read State from it.
	PauseChanged func()
}

// Writer paces a migration's etcd transactions: each waits for room in etcd's
// database and for the rate the pacer allows, and its latency and outcome feed the
// pacer. Safe for concurrent use by a migration's workers.
type Writer struct {
	client       *clientv3.Client
	clock        clock.Clock
	log          klog.Logger
	recordRate   func(float64)
	recordPause  func(string)
	pauseChanged func()

	// serving is the apiserver's request latency (nil outside one); endServing ends
	// this migration's writing there.
	serving    *ServingLatency
	endServing func()
	// members brings the other apiservers' clients' requests (nil: none).
	members MembersServing

	mu    sync.Mutex
	pacer *pacer
	// rescan is the pacer of the latest verifying re-scan (ReadPacer), nil before one.
	rescan  *pacer
	gate    *spaceGate
	limiter *rate.Limiter
	pause   PauseState
	// burst is the most objects of one transaction; the limiter's burst is the
	// batch limit at the rate allowed (burstAt).
	burst int
	// servingBuf is reused to drain serving samples into the pacer.
	servingBuf servingSamples
	// excuseServingUntil: the clients' requests answered before it are not judged.
	// While etcd cannot answer the migration (a member lost, a leader election) it
	// cannot answer the clients either, and their requests that waited out an
	// election (up to etcd's 7 s request timeout) say nothing of the migration's load.
	excuseServingUntil time.Time
	// servingBaselines are the clients' p99 per class before the migration.
	servingBaselines servingBaselines
	// watchCache (nil outside an apiserver) and lag: how far behind the apiserver's
	// watch cache of resource is.
	watchCache WatchCacheRevision
	resource   schema.GroupResource
	lag        watchLag
}

// NewWriter starts pacing a migration: from now until Close, the apiserver's
// requests (Options.Serving) are judged against the baseline they made before.
func NewWriter(opts WriterOptions) *Writer {
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	g := &Writer{
		client: opts.Client, clock: opts.Clock, log: opts.Logger,
		recordRate: opts.RecordRate, recordPause: opts.RecordPause, pauseChanged: opts.PauseChanged,
		pacer: newPacer(opts.Pacing), gate: newSpaceGate(opts.Space), serving: opts.Pacing.Serving, members: opts.Pacing.Members, watchCache: opts.Pacing.WatchCache,
	}
	g.pacer.canProbe = true
	if g.recordRate == nil {
		g.recordRate = func(float64) {}
	}
	if g.recordPause == nil {
		g.recordPause = func(string) {}
	}
	baselines, end := g.serving.begin(servingQuantile)
	g.endServing = end
	if baselines.any() {
		g.servingBaselines = baselines
		g.pacer.SetServingBaseline(baselines)
		g.log.V(2).Info("Storage migration paced by the apiserver's own request latency too", "baselineP99", baselines.String(),
			"servingTargets", g.pacer.servingTargets(), "startRate", g.pacer.Rate())
	}
	g.burst = opts.MaxBatch
	g.limiter = rate.NewLimiter(limitOf(g.pacer.Rate()), burstAt(g.pacer.Rate(), g.burst))
	g.recordRate(g.pacer.Rate())
	return g
}

func limitOf(r float64) rate.Limit {
	if math.IsInf(r, 1) {
		return rate.Inf
	}
	return rate.Limit(r)
}

// Migrating says which resource the transactions from now on write.
func (g *Writer) Migrating(gr schema.GroupResource) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.resource = gr
	g.lag.reset()
}

// observeWatchCache feeds the pacer how far the watch cache is behind a commit at
// revision rev made at now: as far as its last reading showed, at the time of that
// reading. Called with mu held: g.watchCache answers without waiting.
func (g *Writer) observeWatchCache(rev int64, now time.Time) {
	if g.watchCache == nil || rev == 0 {
		return
	}
	cache, at, ok := g.watchCache(g.resource)
	if !ok {
		return
	}
	g.lag.committed(rev, now)
	g.pacer.ObserveWatchLag(g.lag.lag(cache, at))
}

// Close ends the migration's writing: requests answered from now on make the
// serving baseline again.
func (g *Writer) Close() { g.endServing() }

// ClientsHorizon is what the migration judged of its clients within the horizon
// (Options.ServingHorizon), its verifying re-scan's windows included: for the next
// migration of the same rotation (Options.ResumeHorizon).
func (g *Writer) ClientsHorizon() ClientsHorizon {
	g.mu.Lock()
	defer g.mu.Unlock()
	if g.rescan != nil {
		return g.rescan.clientsHorizon()
	}
	return g.pacer.clientsHorizon()
}

// SustainedRate is the highest rate the migration achieved with its clients judged
// within target (0: none): for the next migration's Options.KnownRate.
func (g *Writer) SustainedRate() float64 {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.pacer.SustainedRate()
}

// ClientsOf are the apiservers whose clients pace the migration ("": this one).
func (g *Writer) ClientsOf() []string {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.pacer.ClientsOf()
}

// BatchLimit is how many objects one transaction should carry at the rate allowed
// now: at most batchSpread's worth of it, so that a slow rate is spent evenly rather
// than in bursts of a full batch that stall the clients' requests behind them.
func (g *Writer) BatchLimit() int {
	g.mu.Lock()
	defer g.mu.Unlock()
	return burstAt(g.pacer.Rate(), g.burst)
}

// readCost is how many objects a verifying re-scan may read for each one the migration
// was allowed to write when it ended: a read is no etcd write and no watch event for
// the apiserver's cache to decode, only a decryption (measured idle at a million
// Secrets: the inventory read 26,000 objects/s, the migration wrote 12,000/s).
const readCost = 2

// verifyBudget is the longest a paced re-scan of one resource may take: it reads at
// one etcd revision, and kube-apiserver's compaction (every 5 minutes by default)
// removes that revision 5 to 10 minutes after it was read; a re-scan that outlives it
// starts over. Past the pace the clients allow, it reads as fast as finishing within
// the budget takes.
const verifyBudget = 4 * time.Minute

// ReadPacer paces the pages of a migration's verifying re-scan inside an apiserver
// that has clients to protect: the re-scan of a million objects decrypts them all and
// took the clients' p99 from tens to hundreds of milliseconds while it ran at full
// speed. It is a pacer of its own (read latency is not transaction latency) that
// judges the same clients against the targets the writes ended with, and it is slowed
// only while they are. When the writes' last judgement of the clients found them
// within target it starts unlimited (a read costs etcd a fraction of a write and the
// other apiservers' watch caches nothing; starting at readCost × a rate the writes had
// halved for an etcd hiccup made the re-scan of 10,000 objects 6 s of a 24 s migrate
// stage), and its first window that finds them slowed halves what it achieved. When
// they were slowed, it starts at readCost × the writes' last rate and doubles per
// window they are judged within target (slow start), where the writes' pacer, resumed,
// only added a tenth (a 10,000-object re-scan took 22 s, as long as the rewrite
// itself). Its floor is readCost × the writes' floor. nil (no baseline: no clients)
// reads at full speed.
type ReadPacer struct {
	g       *Writer
	pacer   *pacer
	limiter *rate.Limiter
	// The resource being scanned: when it must be done by, and what is left of it.
	deadline time.Time
	left     int64
}

// ReadPacer returns the pacing of a verifying re-scan, nil when there is no serving
// baseline.
func (g *Writer) ReadPacer() *ReadPacer {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.servingBaselines.any() {
		return nil
	}
	opts := g.pacer.opts
	opts.Ceiling, opts.ResumeRate, opts.MinRate = 0, readCost*g.pacer.Rate(), readCost*opts.MinRate
	p := newPacer(opts)
	p.SetServingBaseline(g.servingBaselines)
	p.inheritServingTargets(g.pacer)
	// The clients were within target while the writes achieved their calm rate, and a
	// read costs 1/readCost of a write: a window of the re-scan far below that with
	// clients slowed shows them slower by themselves (slowerByItself), and the re-scan
	// re-baselines them as the writes would instead of halving to its floor. Without
	// it, a 10,000-Secret re-scan crawled at 200–400 objects/s for 26 s, twice the
	// rewrite, while one follower's clients stayed over target whatever it read.
	p.calmRate = readCost * g.pacer.calmRate
	p.slowStart = true
	if !g.pacer.clientsSlowed {
		p.rate = math.Inf(1)
	}
	g.rescan = p
	return &ReadPacer{g: g, pacer: p, limiter: rate.NewLimiter(limitOf(p.Rate()), 1)}
}

// Resource starts the scan of a resource of about total objects.
func (r *ReadPacer) Resource(total int64) {
	if r == nil {
		return
	}
	r.deadline, r.left = r.g.clock.Now().Add(verifyBudget), total
}

// Wait returns once the rate allows reading a page of objects objects (the page read
// before).
func (r *ReadPacer) Wait(ctx context.Context, objects int) error {
	if r == nil {
		return nil
	}
	r.left -= int64(objects)
	r.g.mu.Lock()
	limit := r.pacer.Rate()
	r.g.mu.Unlock()
	if rest := r.deadline.Sub(r.g.clock.Now()); rest <= 0 {
		limit = math.Inf(1)
	} else if r.left > 0 {
		limit = max(limit, float64(r.left)/rest.Seconds())
	}
	r.limiter.SetLimit(limitOf(limit))
	if objects > r.limiter.Burst() {
		r.limiter.SetBurst(objects)
	}
	return r.limiter.WaitN(ctx, objects)
}

// drainServing hands the clients' requests answered since the last call to p, but
// those answered while etcd was unavailable to the migration (excuseServingUntil).
// g.mu is held.
func (g *Writer) drainServing(p *pacer) {
	excused := g.clock.Now().Before(g.excuseServingUntil)
	g.drainServingBuf(func(member string, c RequestClass, baseline time.Duration, latencies []time.Duration) {
		if !excused {
			p.ObserveMember(member, c, baseline, latencies)
		}
	})
	if excused {
		return
	}
	for c, ds := range g.servingBuf {
		for _, d := range ds {
			p.ObserveServing(RequestClass(c), d)
		}
	}
}

// drainServingBuf empties servingBuf and drains this apiserver's clients' requests
// answered since the last call into it; the other apiservers' go to member (nil:
// they are dropped). g.mu is held.
func (g *Writer) drainServingBuf(member func(member string, c RequestClass, baseline time.Duration, latencies []time.Duration)) {
	g.serving.drain(&g.servingBuf)
	if g.members != nil {
		if member == nil {
			member = func(string, RequestClass, time.Duration, []time.Duration) {}
		}
		g.members.DrainMembers(member)
	}
}

// Read feeds one page read of objects objects that took latency.
func (r *ReadPacer) Read(latency time.Duration, objects int) {
	if r == nil {
		return
	}
	g := r.g
	g.mu.Lock()
	defer g.mu.Unlock()
	g.drainServing(r.pacer)
	before := r.pacer.verdicts
	r.pacer.Observe(g.clock.Now(), latency, objects, nil)
	if v := r.pacer.last; r.pacer.verdicts != before && v.Change == "decrease" {
		g.log.V(2).Info("Verifying re-scan slows down", "cause", v.Cause, "clientsClass", v.ServingClass, "clientsMember", v.ServingMember, "clientsP99", v.ServingP99,
			"clientsTarget", v.ServingTarget, "achieved", v.Achieved, "allowedRate", r.pacer.Rate())
	}
}

// burstAt is the most objects one transaction carries at rate r (+Inf: most).
func burstAt(r float64, most int) int {
	if math.IsInf(r, 1) {
		return most
	}
	return min(most, max(1, int(r*batchSpread.Seconds())))
}

// State is the pause state, the rate allowed now (+Inf: no limit) and why it is
// lower than it started ("": it is not).
func (g *Writer) State() (PauseState, float64, string) {
	g.mu.Lock()
	defer g.mu.Unlock()
	return g.pause, g.pacer.Rate(), g.pacer.SlowedBy()
}

// Txn commits the transaction build makes, writing objects objects of bytes bytes,
// once etcd has room for it and the rate allows it. A write etcd refuses for lack of
// space pauses the migration and is tried again when there is room.
//
// etcd being briefly unavailable is not the migration's failure: while a member is
// lost (its connection reset, a new leader elected) a transaction fails with
// Unavailable, "leader changed" or etcd's own 7 s request timeout. Each attempt gets
// its own deadline (attemptTimeoutFor), and an attempt that failed so is tried again, for up to
// etcdRetryFor, without counting as congestion. The compare-and-swap makes that safe:
// an attempt etcd applied after all makes the next one a conflict, which the caller
// handles as any conflict.
func (g *Writer) Txn(ctx context.Context, objects int, bytes int64, build func(context.Context) clientv3.Txn) (*clientv3.TxnResponse, error) {
	var unavailableSince time.Time
	backoff := etcdRetryBackoff
	for {
		if err := g.admit(ctx, bytes); err != nil {
			return nil, err
		}
		if err := g.waitWhileProbing(ctx); err != nil {
			return nil, err
		}
		if err := waitForTokens(ctx, g.limiter, objects); err != nil {
			return nil, err
		}
		g.mu.Lock()
		attemptTimeout := attemptTimeoutFor(g.pacer.LatencyScale())
		g.mu.Unlock()
		start := g.clock.Now()
		attempt, cancel := context.WithTimeout(ctx, attemptTimeout)
		resp, err := build(attempt).Commit()
		cancel()
		// The transaction's latency ends here: waiting for the lock below is the
		// other workers' business, not etcd's.
		latency := g.clock.Since(start)
		if err != nil && ctx.Err() == nil && etcdunavailable.Is(err) {
			if unavailableSince.IsZero() {
				unavailableSince = start
			}
			g.excuseServing(unavailableSince)
			if g.clock.Since(unavailableSince) < etcdRetryFor {
				g.log.V(2).Info("etcd did not answer a migration transaction; trying again", "err", err, "after", backoff)
				if err := g.sleep(ctx, backoff); err != nil {
					return nil, err
				}
				backoff = min(2*backoff, etcdRetryBackoffMax)
				continue
			}
		}
		if !unavailableSince.IsZero() {
			// etcd answers again; the clients' requests that waited for it end from now
			// on, up to etcd's request timeout after it stopped answering.
			g.excuseServing(unavailableSince)
			unavailableSince = time.Time{}
		}
		noSpace := errors.Is(err, rpctypes.ErrNoSpace)
		g.mu.Lock()
		now := g.clock.Now()
		g.drainServing(g.pacer)
		if err == nil && resp != nil && resp.Header != nil {
			g.observeWatchCache(resp.Header.Revision, now)
		}
		before := g.pacer.verdicts
		g.pacer.Observe(now, latency, objects, err)
		if v := g.pacer.last; g.pacer.verdicts != before {
			g.log.V(4).Info("Storage migration pacing window", "change", v.Change, "cause", v.Cause, "p90", v.P90, "samples", v.Samples, "errors", v.Errors,
				"clientsClass", v.ServingClass, "clientsMember", v.ServingMember, "clientsP99", v.ServingP99, "clientsSamples", v.ServingSamples, "achieved", v.Achieved, "allowedRate", g.pacer.Rate())
			switch v.Change {
			case "probe":
				g.log.V(2).Info("Storage migration pauses to measure the apiserver's clients without it", "clientsClass", v.ServingClass, "clientsMember", v.ServingMember,
					"clientsP99", v.ServingP99, "clientsTarget", v.ServingTarget, "allowedRate", g.pacer.Rate())
			case "decrease":
				g.log.V(2).Info("Storage migration slows down", "cause", v.Cause, "p90", v.P90, "target", g.pacer.Target(),
					"clientsClass", v.ServingClass, "clientsMember", v.ServingMember, "clientsP99", v.ServingP99, "clientsTarget", v.ServingTarget, "watchCacheLag", v.WatchLag,
					"achieved", v.Achieved, "allowedRate", g.pacer.Rate())
			}
		}
		changed := false
		if noSpace {
			g.gate.NoSpace(now)
			changed = g.update(now)
		}
		g.limiter.SetLimit(limitOf(g.pacer.Rate()))
		g.limiter.SetBurst(burstAt(g.pacer.Rate(), g.burst))
		g.recordRate(g.pacer.Rate())
		g.mu.Unlock()
		g.notify(changed)
		if !noSpace {
			return resp, err
		}
	}
}

// probePoll is how often a paused migration hands its clients' requests to the pacer.
const probePoll = 100 * time.Millisecond

// waitWhileProbing returns once the pacer does not pause the migration to measure its
// clients (pacer.startProbe), feeding it their requests meanwhile.
func (g *Writer) waitWhileProbing(ctx context.Context) error {
	for {
		g.mu.Lock()
		if !g.pacer.Probing() {
			g.mu.Unlock()
			return nil
		}
		g.drainServing(g.pacer)
		g.pacer.tickProbe(g.clock.Now())
		if v := g.pacer.last; !g.pacer.Probing() {
			g.log.V(2).Info("Storage migration measured the apiserver's clients without it", "clientsClass", v.ServingClass, "clientsMember", v.ServingMember, "clientsP99", v.ServingP99,
				"clientsSamples", v.ServingSamples, "servingTargets", g.pacer.servingTargets(), "result", g.pacer.SlowedBy())
			g.mu.Unlock()
			return nil
		}
		g.mu.Unlock()
		if err := g.sleep(ctx, probePoll); err != nil {
			return err
		}
	}
}

// etcdRequestTimeout is how long etcd lets a request wait for its proposal to be
// applied by default (5 s plus two election timeouts): a client request sent to a
// member whose leader was just lost can take that long, then fail.
const etcdRequestTimeout = 7 * time.Second

// excuseServing drops the clients' requests answered so far, and has those answered
// until a pacing window from now, or until etcd's request timeout (and a window) after
// etcd stopped answering at since, dropped too (see excuseServingUntil).
func (g *Writer) excuseServing(since time.Time) {
	g.mu.Lock()
	defer g.mu.Unlock()
	g.excuseServingLocked(since)
}

// excuseServingLocked is excuseServing with g.mu held.
func (g *Writer) excuseServingLocked(since time.Time) {
	g.drainServingBuf(nil)
	// Those the pacer was holding for a judgement go too: too few to judge before the
	// outage, they would hold the rate for windows after it (a killed etcd leader
	// held a migration at 100 objects/s for 3 s so).
	g.pacer.dropServing()
	until := g.clock.Now()
	if end := since.Add(etcdRequestTimeout); end.After(until) {
		until = end
	}
	if until = until.Add(g.pacer.opts.Window); until.After(g.excuseServingUntil) {
		g.excuseServingUntil = until
	}
}

// An attempt of a migration transaction is bounded: a batch commits in milliseconds,
// and an attempt sent to a member that went down, or forwarded to a leader that was
// just killed, would otherwise wait for etcd's 7 s request timeout (a proposal sent
// while a member knows no leader waits for the election inside etcd and goes
// through). The bound is attemptTimeoutPerTarget times the pacer's latency target
// (LatencyScale: from the first transactions before the target is set), within [minEtcdAttemptTimeout, maxEtcdAttemptTimeout]: a lost attempt is given up
// soon after the election, and a slow but healthy etcd keeps its time.
const (
	minEtcdAttemptTimeout   = time.Second
	maxEtcdAttemptTimeout   = 3 * time.Second
	attemptTimeoutPerTarget = 20
)

// attemptTimeoutFor is the bound of one attempt for the pacer's latency scale (0:
// no transaction answered yet).
func attemptTimeoutFor(target time.Duration) time.Duration {
	if target <= 0 {
		return maxEtcdAttemptTimeout
	}
	return min(max(attemptTimeoutPerTarget*target, minEtcdAttemptTimeout), maxEtcdAttemptTimeout)
}

// etcdRetryFor is how long a transaction is tried again while etcd is unavailable; past
// it the migration fails and the controller retries it (from its checkpoint).
const etcdRetryFor = 30 * time.Second

// etcdRetryBackoff and etcdRetryBackoffMax space the attempts.
const (
	etcdRetryBackoff    = 100 * time.Millisecond
	etcdRetryBackoffMax = 2 * time.Second
)

// waitForTokens waits until l allows n events. A batch is sized from the burst when it
// is built, and another worker's transaction may lower the burst before this one
// commits: rate.Limiter.WaitN fails outright for n above the burst ("Wait(n=10)
// exceeds limiter's burst 1", which aborted a migration). The tokens are taken in
// pieces no larger than the burst read at each step, so the batch is paced at the new
// rate instead.
func waitForTokens(ctx context.Context, l *rate.Limiter, n int) error {
	for n > 0 {
		piece := min(n, max(1, l.Burst()))
		if err := l.WaitN(ctx, piece); err != nil {
			return err
		}
		n -= piece
	}
	return nil
}

// admit returns once the space gate lets bytes be written.
func (g *Writer) admit(ctx context.Context, bytes int64) error {
	for {
		g.mu.Lock()
		d := g.gate.Admit(g.clock.Now(), bytes)
		if d == spaceMeasure {
			// Read under the lock: one reading serves every worker. Each read is bounded
			// as a transaction's attempt is: a read caught in a leader election is given
			// up and tried again soon (unknownRetry).
			readStart := g.clock.Now()
			s := readSpace(ctx, g.client, attemptTimeoutFor(g.pacer.LatencyScale()))
			if ctx.Err() != nil {
				g.mu.Unlock()
				return ctx.Err()
			}
			if s.Err != nil && etcdunavailable.Is(s.Err) {
				// The same outage as a transaction's (a migration that starts during a
				// leader election meets it here first): the clients' requests waiting
				// for etcd meanwhile say nothing of the migration's load.
				g.excuseServingLocked(readStart)
			}
			g.gate.Measured(g.clock.Now(), s)
			d = g.gate.Admit(g.clock.Now(), bytes)
		}
		changed := g.update(g.clock.Now())
		g.mu.Unlock()
		g.notify(changed)
		if d == spaceWrite {
			return nil
		}
		if d == spaceWait {
			g.mu.Lock()
			wait := g.gate.RetryIn(g.clock.Now())
			g.mu.Unlock()
			if err := g.sleep(ctx, wait); err != nil {
				return err
			}
		}
	}
}

// update reports a change of the gate's pause state in the log and the metric, and
// whether the status must be told (notify, once mu is released).
func (g *Writer) update(now time.Time) bool {
	reason := g.gate.Paused()
	if reason == g.pause.Reason {
		if reason != "" {
			g.pause.Condition = g.gate.Condition()
		}
		return false
	}
	if reason == "" {
		g.log.Info("Storage migration resumes: etcd has room again", "pausedFor", now.Sub(g.pause.Since), "dbSize", g.gate.last.DBSize, "dbSizeInUse", g.gate.last.DBSizeInUse)
		g.pause = PauseState{}
	} else {
		g.log.Info("Storage migration paused before etcd runs out of space", "reason", reason, "condition", g.gate.Condition(),
			"dbSize", g.gate.last.DBSize, "dbSizeInUse", g.gate.last.DBSizeInUse, "quotaBytes", g.gate.opts.QuotaBytes)
		g.pause = PauseState{Reason: reason, Condition: g.gate.Condition(), Since: now}
	}
	g.recordPause(reason)
	return true
}

func (g *Writer) notify(changed bool) {
	if changed && g.pauseChanged != nil {
		g.pauseChanged()
	}
}

func (g *Writer) sleep(ctx context.Context, d time.Duration) error {
	t := g.clock.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-t.C():
		return nil
	}
}

// readSpace reads the largest database of etcd's members and whether NOSPACE is
// raised. Compaction and defragmentation are never asked for: they are
// kube-apiserver's and the operator's. The members are asked at once, each with its
// own timeout: a member that is down (it cannot grow either) must not stall the
// reading, so once one member answered the others get spaceReadGrace more. timeout
// bounds one member's answer, and the alarm list.
func readSpace(ctx context.Context, cli *clientv3.Client, timeout time.Duration) etcdSpace {
	type answer struct {
		st  *clientv3.StatusResponse
		err error
	}
	eps := cli.Endpoints()
	answers := make(chan answer, len(eps))
	for _, ep := range eps {
		go func() {
			c, cancel := context.WithTimeout(ctx, timeout)
			defer cancel()
			st, err := cli.Status(c, ep)
			if err != nil {
				err = fmt.Errorf("etcd member %s: %w", ep, err)
			}
			answers <- answer{st, err}
		}()
	}
	var s etcdSpace
	var errs []error
	answered := 0
	var grace <-chan time.Time
collect:
	for range eps {
		select {
		case a := <-answers:
			if a.err != nil {
				errs = append(errs, a.err)
				continue
			}
			s.DBSize = max(s.DBSize, a.st.DbSize)
			s.DBSizeInUse = max(s.DBSizeInUse, a.st.DbSizeInUse)
			if answered++; answered == 1 {
				t := time.NewTimer(spaceReadGrace)
				defer t.Stop()
				grace = t.C
			}
		case <-grace:
			break collect
		}
	}
	if answered == 0 {
		return etcdSpace{Err: fmt.Errorf("reading the database size of etcd: %w", errors.Join(errs...))}
	}
	// A new variable: the members' goroutines still running past the grace read ctx.
	alarmCtx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	alarms, err := cli.AlarmList(alarmCtx)
	if err != nil {
		return etcdSpace{Err: fmt.Errorf("reading etcd's alarms: %w", err)}
	}
	for _, a := range alarms.Alarms {
		if a.Alarm == etcdserverpb.AlarmType_NOSPACE {
			s.NoSpace = true
		}
	}
	return s
}
