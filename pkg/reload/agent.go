// Package reload keeps an apiserver's encryption-at-rest configuration current. The Agent
// loads the configuration file, builds a transformers.Set from it and serves it as the
// apiserver's value.ResourceTransformers. While running it watches the file (fsnotify
// on the parent directory, plus a slow poll for file systems without events), and when
// the content changes it loads, builds and health-gates the new configuration, then
// swaps it in atomically. A bad change is refused: the old Set keeps serving, the error
// is recorded (status document, metrics, log) and the attempt is retried with backoff.
//
// Every storage call loads the current Set once and finishes on it, so a call never
// mixes two configurations; a replaced Set is closed after a grace period, once the
// calls that started on it have returned.
//
// Several apiservers can share the decision of which key writes: Options.WriteFence
// chooses, per resource rule, the chain entry that writes (pkg/cluster holds a new key
// back until every apiserver can read it), and Refence swaps when its answer changes.
//
//	agent, err := reload.NewAgent(ctx, reload.Options{Path: path, AutomaticReload: true, ...})
//	if err != nil { ... }            // missing or invalid file
//	defer agent.Close()
//	err = agent.InstallInto(serverConfig) // transformers, kms-providers check, post-start hook
package reload

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/healthz"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Defaults. The poll interval is upstream's; the debounce only has to cover the gap
// between the system calls of one writer.
const (
	DefaultPollInterval = time.Minute
	DefaultDebounce     = 10 * time.Millisecond
	// MinGracePeriod bounds the default grace period from below: a configuration without
	// KMS providers still lets in-flight calls finish before its Set is closed.
	MinGracePeriod = 5 * time.Second
	// MinHealthGateTimeout is upstream's lower bound for the health gate of new plugins.
	MinHealthGateTimeout = 10 * time.Second

	retryInitial = 500 * time.Millisecond
	retryMax     = time.Minute
	// maxDebounceWaitFactor × Debounce keeps a writer that never stops writing from
	// postponing a reload forever.
	maxDebounceWaitFactor = 10
	// drainLimit bounds how long a replaced Set waits, after its grace period, for the
	// calls still running on it; only a call stuck far beyond every KMS timeout hits it.
	drainLimit = time.Minute
	// changedDuringLoadRetries bounds how often one Reload starts over because the file
	// changed while it was being loaded.
	changedDuringLoadRetries = 3
)

var (
	errClosed            = errors.New("reload agent is closed")
	errChangedDuringLoad = errors.New("encryption provider configuration file changed while it was being loaded")
)

// Options configure an Agent.
type Options struct {
	// Path is the encryption provider configuration file (--encryption-provider-config).
	Path string
	// AutomaticReload enables watching and reloading. When false the file is loaded once
	// (--encryption-provider-config-automatic-reload=false) and Run returns at once.
	AutomaticReload bool
	// PollInterval is how often the file is re-read even without file events; default 1m.
	PollInterval time.Duration
	// Debounce is how long the agent waits after the last file event before reading.
	Debounce time.Duration
	// GracePeriod is how long a replaced Set keeps serving calls that started on it
	// before it is closed. Default: 2 × the sum of the old configuration's KMS timeouts,
	// at least MinGracePeriod.
	GracePeriod time.Duration
	// HealthGateTimeout bounds how long new KMS providers get to pass Status and produce
	// a write DEK. Default: the sum of the new configuration's KMS timeouts, at least
	// MinHealthGateTimeout.
	HealthGateTimeout time.Duration
	// Transformers are passed to transformers.Build.
	Transformers transformers.Options
	// Registry receives the agent's metrics; nil records none.
	Registry metrics.KubeRegistry
	// APIServerID is hashed into the metrics' apiserver_id_hash label.
	APIServerID string
	// Logger defaults to klog's background logger.
	Logger klog.Logger
	// Clock defaults to the real clock.
	Clock clock.Clock
	// Guard, when set, may veto a new configuration; an error refuses the reload. It
	// runs before the new configuration is built.
	Guard func(current, next *config.Config) error
	// SetGuard, when set, may veto a new configuration after it is built and has
	// passed the health gate, before it is swapped in: it gets the new Set (not yet
	// serving), e.g. to prove that its KMS plugins decrypt stored data. An error
	// refuses the reload and closes the Set.
	SetGuard func(ctx context.Context, current, next *config.Config, set *transformers.Set) error
	// Applied, when set, is called after every successful swap with the configuration
	// now serving (e.g. to persist what it can read). It runs on the reload path and
	// should return quickly.
	Applied func(cfg *config.Config)
	// StatusExtras, when set, adds sections to the status document: each key becomes a
	// top-level member (e.g. "storage") next to the agent's own, which win on a clash.
	// It is called on every Status call and must be safe for concurrent use; what it
	// returns must hold no key material.
	StatusExtras func() map[string]any
	// WriteFence, when set, chooses which entry of each resource rule's chain writes.
	// It is given the rules of the Set serving now (nil at start) and of the Set about
	// to serve (built from the configuration, so every WriteIndex is 0 and ReadKeys[0]
	// is the configuration's write key), and returns, by RuleInfo.Resource, the index
	// in ReadKeys of the entry that must write, or that no entry may (Writer.Refuse:
	// writes then fail with a ServiceUnavailable error); a rule it does not name writes
	// with its first entry. The agent installs a Set derived with
	// transformers.Set.WithWriters.
	// Call Refence when the answer may have changed (e.g. another apiserver can now read
	// a held key). It must not block and must not call back into the Agent. A cluster
	// write fence (pkg/cluster) implements it; pkg/reload does not know about clusters.
	WriteFence func(current, next []transformers.RuleInfo) map[string]transformers.Writer
	// WriteGate, when set, is asked before every write; a non-nil error refuses the
	// write with it (a *transformers.WriteRefusedError answers 503). It covers what a
	// swapped Set cannot: the moment a paused process runs again, before any of its
	// goroutines has noticed the pause and applied the fence again. It must be cheap and
	// must not block (it runs on every write).
	WriteGate func() error
	// OnChange, when set, is called after every swap: an applied configuration, a
	// promotion or hold by Refence. It runs on the swapping goroutine and must only
	// signal (e.g. a non-blocking send), never call back into the Agent.
	OnChange func()
	// Events, when set, receives the agent's events for `kubectl get events`: a
	// configuration applied or refused, a read key dropped, a write key the fence
	// promoted (events.Nop by default).
	Events events.Sink
}

// generation is one applied configuration and the calls running on it.
type generation struct {
	cfg      *config.Config
	set      *transformers.Set
	loadedAt time.Time

	inflight  atomic.Int64
	retired   atomic.Bool
	drainOnce sync.Once
	drained   chan struct{} // closed when retired and no call is running
}

func newGeneration(cfg *config.Config, set *transformers.Set, now time.Time) *generation {
	return &generation{cfg: cfg, set: set, loadedAt: now, drained: make(chan struct{})}
}

func (g *generation) release() {
	// A retiring generation is marked before its closer reads inflight, and a call
	// decrements before it reads retired, so one of the two always sees the other.
	if g.inflight.Add(-1) == 0 && g.retired.Load() {
		g.drainOnce.Do(func() { close(g.drained) })
	}
}

// Agent serves the current encryption configuration and reloads it.
type Agent struct {
	opts    Options
	log     klog.Logger
	clock   clock.Clock
	health  *healthz.Checker
	metrics *reloadMetrics
	events  events.Sink

	cur atomic.Pointer[generation]

	reloadMu sync.Mutex // one load/build/swap at a time

	stateMu sync.Mutex
	state   attemptState

	closed      atomic.Bool
	closeOnce   sync.Once
	closeCtx    context.Context
	closeCancel context.CancelFunc
	retiring    sync.WaitGroup // grace-period closers
	pending     atomic.Int64   // replaced Sets not yet closed

	// pollOnly skips file events, as on a file system without them (tests).
	pollOnly bool
}

// attemptState is what the status document reports about reload attempts.
type attemptState struct {
	succeeded, failed int64
	lastAttemptAt     time.Time
	lastErr           string
	lastErrAt         time.Time
	lastErrHash       string
}

// NewAgent loads and builds the configuration at opts.Path. A missing or invalid file
// is an error; a KMS plugin that is not reachable is not (its provider starts and the
// kms-providers check reports it until it answers).
func NewAgent(ctx context.Context, opts Options) (*Agent, error) {
	if opts.Path == "" {
		return nil, errors.New("reload: no encryption provider configuration file given (--encryption-provider-config)")
	}
	if opts.PollInterval <= 0 {
		opts.PollInterval = DefaultPollInterval
	}
	if opts.Debounce <= 0 {
		opts.Debounce = DefaultDebounce
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	if opts.Transformers.Clock == nil {
		opts.Transformers.Clock = opts.Clock
	}
	if opts.Transformers.Logger.GetSink() == nil {
		opts.Transformers.Logger = opts.Logger
	}
	if opts.Transformers.APIServerID == "" {
		opts.Transformers.APIServerID = opts.APIServerID
	}
	if opts.Transformers.WriteCounts == nil {
		// One set of counters for the agent's lifetime: every Set it builds, on start
		// and on each reload, continues the counts of the keys it keeps.
		opts.Transformers.WriteCounts = transformers.NewWriteCounts()
	}
	a := &Agent{
		opts:   opts,
		log:    opts.Logger.WithName("encryption-config-reload"),
		clock:  opts.Clock,
		health: healthz.New(healthz.Options{}),
		events: events.OrNop(opts.Events),
	}
	a.closeCtx, a.closeCancel = context.WithCancel(context.Background())

	cfg, err := config.Load(opts.Path, config.Options{Reload: opts.AutomaticReload})
	if err != nil {
		a.closeCancel()
		return nil, err
	}
	if opts.Registry != nil {
		if a.metrics, err = newReloadMetrics(opts.Registry, opts.APIServerID, opts.Transformers.FIPS != transformers.FIPSOff); err != nil {
			a.closeCancel()
			return nil, fmt.Errorf("reload: registering metrics: %w", err)
		}
		if err := opts.Registry.CustomRegister(newKeyWritesCollector(opts.Transformers.WriteCounts)); err != nil {
			a.closeCancel()
			return nil, fmt.Errorf("reload: registering %s: %w", KeyWritesMetric, err)
		}
	}
	set, err := transformers.Build(ctx, cfg, opts.Transformers)
	if err != nil {
		a.closeCancel()
		return nil, fmt.Errorf("building transformers from %q: %w", opts.Path, err)
	}
	if set, err = a.fenced(nil, set); err != nil {
		a.closeCancel()
		return nil, err
	}
	a.install(newGeneration(cfg, set, a.clock.Now()))
	a.metrics.setConfig(cfg.Hash)
	a.log.Info("Loaded encryption provider configuration", "path", opts.Path, "hash", cfg.Hash,
		"kmsProviders", len(set.KMSProviders()), "automaticReload", opts.AutomaticReload)
	return a, nil
}

// install makes g current and points the health check at its KMS providers; it returns
// the generation it replaced.
func (a *Agent) install(g *generation) *generation {
	old := a.cur.Swap(g)
	kms := g.set.KMSProviders()
	probes := make([]healthz.Probe, len(kms))
	for i, k := range kms {
		probes[i] = k
	}
	a.health.Swap(probes...)
	return old
}

// acquire returns the current generation with a call counted on it. The caller must
// release it.
func (a *Agent) acquire() *generation {
	for {
		g := a.cur.Load()
		g.inflight.Add(1)
		if !g.retired.Load() || g == a.cur.Load() {
			return g
		}
		// The generation was replaced and its grace period ended between the load and
		// the count: run on the current one instead.
		g.release()
	}
}

// Reload reads the file now and applies it if its content changed. It returns nil when
// the content is unchanged or was applied; on any error the current configuration keeps
// serving and the error is recorded.
func (a *Agent) Reload(ctx context.Context) error {
	_, err := a.reload(ctx)
	return err
}

// reload is Reload that also returns the content hash it attempted ("" when the file
// could not be read).
func (a *Agent) reload(ctx context.Context) (string, error) {
	if a.closed.Load() {
		return "", errClosed
	}
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(a.closeCtx, cancel)
	defer stop()

	for attempt := 0; ; attempt++ {
		hash, err := a.reloadOnce(ctx)
		if errors.Is(err, errChangedDuringLoad) && attempt < changedDuringLoadRetries {
			continue
		}
		return hash, err
	}
}

func (a *Agent) reloadOnce(ctx context.Context) (string, error) {
	start := a.clock.Now()
	a.stateMu.Lock()
	a.state.lastAttemptAt = start
	a.stateMu.Unlock()

	data, hash, err := config.ReadFile(a.opts.Path)
	if err != nil {
		return "", a.fail(ctx, "", err)
	}
	cur := a.cur.Load()
	if hash == cur.cfg.Hash {
		a.log.V(4).Info("Encryption provider configuration unchanged", "hash", hash)
		return hash, nil
	}
	cfg, err := config.Parse(data, a.opts.Path, config.Options{Reload: true})
	if err != nil {
		return hash, a.fail(ctx, hash, err)
	}
	if a.opts.Guard != nil {
		if err := a.opts.Guard(cur.cfg, cfg); err != nil {
			return hash, a.fail(ctx, hash, fmt.Errorf("new configuration refused: %w", err))
		}
	}
	buildCtx, cancel := context.WithTimeout(ctx, a.healthGateTimeout(cfg))
	defer cancel()
	set, err := transformers.Build(buildCtx, cfg, a.opts.Transformers)
	if err != nil {
		return hash, a.fail(ctx, hash, fmt.Errorf("building transformers: %w", err))
	}
	if err := healthGate(buildCtx, set); err != nil {
		set.Close()
		return hash, a.fail(ctx, hash, err)
	}
	if a.opts.SetGuard != nil {
		if err := a.opts.SetGuard(buildCtx, cur.cfg, cfg, set); err != nil {
			set.Close()
			return hash, a.fail(ctx, hash, fmt.Errorf("new configuration refused: %w", err))
		}
	}
	// A writer may have replaced the file again while this one was being built (for
	// example a truncate that was followed by the rest of the content): apply only
	// what the file still holds.
	if _, now, err := config.ReadFile(a.opts.Path); err == nil && now != hash {
		set.Close()
		return hash, errChangedDuringLoad
	}
	if a.closed.Load() {
		set.Close()
		return hash, errClosed
	}
	if set, err = a.fenced(cur.set.Rules(), set); err != nil {
		return hash, a.fail(ctx, hash, err)
	}

	now := a.clock.Now()
	a.stateMu.Lock() // the status document sees the swap and its count together
	old := a.install(newGeneration(cfg, set, now))
	a.state.succeeded++
	a.stateMu.Unlock()
	a.retire(old)
	a.metrics.record(statusSuccess, now, hash)
	a.log.Info("Applied new encryption provider configuration", "path", a.opts.Path,
		"hash", hash, "previousHash", old.cfg.Hash, "took", now.Sub(start),
		"kmsProviders", len(set.KMSProviders()), "heldWriteKeys", heldKeys(set))
	if a.opts.Applied != nil {
		a.opts.Applied(cfg)
	}
	a.reportApplied(old.set.Rules(), set.Rules(), hash)
	a.changed()
	return hash, nil
}

// fenced returns set, or when the write fence holds a rule's first entry back, a Set
// derived from it that writes with the entry the fence chose (set is then released).
func (a *Agent) fenced(current []transformers.RuleInfo, set *transformers.Set) (*transformers.Set, error) {
	if a.opts.WriteFence == nil {
		return set, nil
	}
	writers := a.opts.WriteFence(current, set.Rules())
	if sameWriters(set.Rules(), writers) {
		return set, nil
	}
	derived, err := set.WithWriters(writers)
	set.Close() // the derived Set keeps the providers
	if err != nil {
		return nil, fmt.Errorf("write fence: %w", err)
	}
	return derived, nil
}

// sameWriters reports whether rules already write with the entries writers names (or
// refuse for the same reason).
func sameWriters(rules []transformers.RuleInfo, writers map[string]transformers.Writer) bool {
	for _, r := range rules {
		if !writes(r, writers[r.Resource]) {
			return false
		}
	}
	return true
}

// writes reports whether rule r does what w says.
func writes(r transformers.RuleInfo, w transformers.Writer) bool {
	if w.Refuse != "" || r.WriteRefused != "" {
		return w.Refuse == r.WriteRefused
	}
	return w.Index == r.WriteIndex
}

// writerName is the entry rule r writes with, for the log.
func writerName(r transformers.RuleInfo) string {
	if k, ok := r.Writer(); ok {
		return k.String()
	}
	return "none (writes refused: " + r.WriteRefused + ")"
}

// heldKeys lists, for the log, the rules whose configured write key is held back.
func heldKeys(set *transformers.Set) []string {
	var held []string
	for _, r := range set.Rules() {
		if r.WriteIndex != 0 {
			held = append(held, r.Resource+": "+r.ReadKeys[0].String()+" held, writing "+writerName(r))
		}
	}
	return held
}

// Refence asks Options.WriteFence again which entries write, and when the answer
// differs from the Set serving now, swaps in a Set derived from the same build with
// the new writers: a held key is promoted (or a key held back again). The swap is the
// same atomic one as a reload; the configuration and its hash do not change. Without a
// WriteFence it does nothing.
func (a *Agent) Refence() error {
	if a.opts.WriteFence == nil {
		return nil
	}
	if a.closed.Load() {
		return errClosed
	}
	a.reloadMu.Lock()
	defer a.reloadMu.Unlock()
	cur := a.cur.Load()
	rules := cur.set.Rules()
	writers := a.opts.WriteFence(rules, rules)
	if sameWriters(rules, writers) {
		return nil
	}
	derived, err := cur.set.WithWriters(writers)
	if err != nil {
		return fmt.Errorf("write fence: %w", err)
	}
	a.stateMu.Lock()
	old := a.install(newGeneration(cur.cfg, derived, cur.loadedAt))
	a.stateMu.Unlock()
	a.retire(old)
	for _, r := range derived.Rules() {
		if !writes(r, writers[r.Resource]) {
			continue
		}
		for _, o := range rules {
			if o.Resource == r.Resource && (o.WriteIndex != r.WriteIndex || o.WriteRefused != r.WriteRefused) {
				a.log.Info("Write fence changed the write key", "resource", r.Resource,
					"writeKey", writerName(r), "previous", writerName(o),
					"configuredWriteKey", r.ReadKeys[0].String())
				a.reportRefenced(r, o)
			}
		}
	}
	a.changed()
	return nil
}

// changed tells Options.OnChange that a new Set serves.
func (a *Agent) changed() {
	if a.opts.OnChange != nil {
		a.opts.OnChange()
	}
}

// fail records a refused reload and returns err.
func (a *Agent) fail(ctx context.Context, hash string, err error) error {
	if a.closed.Load() {
		return errClosed
	}
	if ctx.Err() != nil && errors.Is(err, ctx.Err()) {
		return err // the caller gave up (shutdown): not a verdict on the file
	}
	now := a.clock.Now()
	a.metrics.record(statusFailure, now, "")
	a.stateMu.Lock()
	a.state.failed++
	// The status document is published in the member record: bounded, so a huge
	// broken file cannot make the record too large for etcd. The log keeps it whole.
	a.state.lastErr, a.state.lastErrAt, a.state.lastErrHash = errtext.Bounded(err, errtext.MaxPublished), now, hash
	a.stateMu.Unlock()
	a.log.Error(err, "Refused encryption provider configuration; the previous one keeps serving",
		"path", a.opts.Path, "hash", hash, "activeHash", a.cur.Load().cfg.Hash)
	a.events.Event(events.Warning, events.ReasonConfigRefused, refusedMessage(hash, err))
	return err
}

// healthGate waits for every KMS provider of a new Set to pass Status and hold a write
// DEK, all within ctx.
func healthGate(ctx context.Context, set *transformers.Set) error {
	kms := set.KMSProviders()
	if len(kms) == 0 {
		return nil
	}
	errs := make([]error, len(kms))
	var wg sync.WaitGroup
	for i, k := range kms {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if err := k.WaitReady(ctx); err != nil {
				errs[i] = fmt.Errorf("kms provider %q did not become ready to write: %w", k.Name(), err)
				return
			}
			if err := k.Check(ctx); err != nil {
				errs[i] = fmt.Errorf("kms provider %q is unhealthy: %w", k.Name(), err)
			}
		}()
	}
	wg.Wait()
	if err := utilerrors.NewAggregate(errs); err != nil {
		return fmt.Errorf("health check for new transformers failed: %w", utilerrors.Reduce(err))
	}
	return nil
}

// retire closes g's Set once its grace period has passed and the calls that started on
// it have returned (waiting at most drainLimit more for those), or at once when the
// agent closes.
func (a *Agent) retire(g *generation) {
	grace := a.gracePeriod(g.cfg)
	a.pending.Add(1)
	a.retiring.Add(1)
	go func() {
		defer a.retiring.Done()
		defer a.pending.Add(-1)
		t := a.clock.NewTimer(grace)
		select {
		case <-t.C():
		case <-a.closeCtx.Done():
		}
		t.Stop()
		g.retired.Store(true)
		if g.inflight.Load() > 0 {
			t := a.clock.NewTimer(max(grace, drainLimit))
			select {
			case <-g.drained:
			case <-t.C():
				a.log.Info("Closing a replaced encryption configuration with calls still running on it",
					"hash", g.cfg.Hash, "calls", g.inflight.Load())
			case <-a.closeCtx.Done():
			}
			t.Stop()
		}
		g.set.Close()
		a.log.V(2).Info("Closed replaced encryption configuration", "hash", g.cfg.Hash)
	}()
}

func (a *Agent) gracePeriod(cfg *config.Config) time.Duration {
	if a.opts.GracePeriod > 0 {
		return a.opts.GracePeriod
	}
	return max(2*kmsTimeoutSum(cfg), MinGracePeriod)
}

func (a *Agent) healthGateTimeout(cfg *config.Config) time.Duration {
	if a.opts.HealthGateTimeout > 0 {
		return a.opts.HealthGateTimeout
	}
	return max(kmsTimeoutSum(cfg), MinHealthGateTimeout)
}

// kmsTimeoutSum adds the call timeouts of every kms provider entry, as upstream sizes
// its close grace period. Every entry is v2: config validation refuses v1.
func kmsTimeoutSum(cfg *config.Config) time.Duration {
	var sum time.Duration
	for _, rc := range cfg.Encryption.Resources {
		for _, p := range rc.Providers {
			if p.KMS == nil {
				continue
			}
			sum += config.KMSTimeout(p.KMS)
		}
	}
	return sum
}

// Close closes the current Set and every replaced one still in its grace period, and
// stops accepting reloads. Run's loops end with their context, not with Close. Close
// waits for a reload in progress to give up. Safe to call more than once.
func (a *Agent) Close() {
	a.closeOnce.Do(func() {
		a.closed.Store(true)
		a.closeCancel()
		a.reloadMu.Lock()
		g := a.cur.Load()
		a.reloadMu.Unlock()
		a.retiring.Wait()
		g.set.Close()
	})
}
