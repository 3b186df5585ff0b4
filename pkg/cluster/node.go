package cluster

import (
	"context"
	"errors"
	"fmt"
	"runtime/debug"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/etcdunavailable"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Defaults of Options.
const (
	DefaultLeaseTTL          = 10 * time.Second
	DefaultDisagreementAlarm = 2 * time.Minute
	// DefaultRefreshInterval is how often the member state is published without a change.
	DefaultRefreshInterval = 30 * time.Second
	// tickInterval drives alarms, fence hold times and the cheap re-check of the agent's
	// view (a KMS key id change that no hook reported).
	tickInterval = time.Second
)

// reloadAgent is what a Node needs of reload.Agent.
type reloadAgent interface {
	OwnStatus() reload.Status
	Refence() error
}

// Options configure a Node.
type Options struct {
	// Client talks to the apiservers' etcd (built from the storage backend's flags).
	Client *clientv3.Client
	// ID names this apiserver (--apiserver-id).
	ID string
	// Prefix is the coordination prefix (default /rekey); ResourcePrefix the storage
	// prefix it must stay outside of (--etcd-prefix).
	Prefix         string
	ResourcePrefix string
	// LeaseTTL is the member key's lease (default 10 s): a dead apiserver stops counting
	// this long after its last keep-alive.
	LeaseTTL time.Duration
	// DisagreementAlarm is how long members may disagree about a write key before the
	// alarm (default 2 min).
	DisagreementAlarm time.Duration
	// RefreshInterval re-publishes an unchanged state (default 30 s).
	RefreshInterval time.Duration
	// Version is the rekey version published (default: the main module's).
	Version string
	// MigratesResources are the resources this apiserver migrates when it is the
	// elected migration leader; nil with --storage-migration off. Published in the
	// member record (MemberState.StorageMigration).
	MigratesResources []string
	// BackupRetention is this apiserver's --backup-retention, published in its member
	// record (MemberState.BackupRetention).
	BackupRetention time.Duration
	// KeyWritesFlushInterval is how often this member adds its per-key write counts to
	// the cluster's totals in etcd (default defaultKeyWritesFlushInterval); it adds
	// them once more on Close.
	KeyWritesFlushInterval time.Duration
	// Inventory is the latest local inventory (for readiness and the guard); may be nil.
	Inventory *migrate.InventoryStore
	Metrics   *Metrics
	Logger    klog.Logger
	Clock     clock.WithTicker
	// Events receives the node's events: a write key held back or writes refused by
	// the fence, this apiserver straggling, a key conflict involving it, the
	// disagreement alarm (events.Nop by default).
	Events events.Sink
}

// Node is one apiserver's part of the cluster: it publishes its member state, watches
// the others, runs the write fence for its reload.Agent, and serves readiness, guard
// and status. Wire it as reload.Options.WriteFence (Node.WriteFence) and
// reload.Options.OnChange (Node.Notify) before the agent starts, then Attach the agent.
type Node struct {
	opts Options
	log  klog.Logger
	view *view
	pub  *publisher

	mu          sync.Mutex
	fence       *fence
	handshake   *handshake
	dropping    *dropPlan // the drop announced by Guard, nil when none
	alarm       *disagreementAlarm
	agent       reloadAgent
	migrator    *Migrator
	published   MemberState
	lastPublish time.Time
	publishErr  string
	// clusterID is the cluster's identity (Start reads or creates it).
	clusterID string
	// publishFailingSince is when publishing started to fail (zero while it works): a
	// member that cannot publish for longer than its lease has vanished from the
	// others' views and fails its own readiness.
	publishFailingSince time.Time
	// publishMu makes computing a state and putting it one step, so an older state
	// can never overwrite a drop announced in between.
	publishMu sync.Mutex

	// keyWrites adds this member's write counts to the cluster's totals; keyTotals is
	// what it last read back, at lastKeyWritesFlush.
	keyWrites          *keyWritesFlusher
	keyTotals          []KeyTotal
	lastKeyWritesFlush time.Time
	// edges reports straggling and conflicts once per change (under mu).
	edges nodeEvents

	notify chan struct{}
	// resyncChanged asks the loop to apply the fence again and, while the fence waits
	// for this apiserver's record, to publish it: a loss was detected, or the
	// resynchronisation ended, outside the loop (see fence_resync.go).
	resyncChanged chan struct{}
	// ticked is when watchPauses last stepped the clock (nil before Start): WriteGate
	// compares it with the clock on every write.
	ticked atomic.Pointer[time.Time]

	cancel context.CancelFunc
	done   chan struct{}
}

// New validates opts and returns a Node; call Start before building the agent.
func New(opts Options) (*Node, error) {
	if opts.Client == nil {
		return nil, errors.New("cluster: no etcd client")
	}
	if opts.Prefix == "" {
		opts.Prefix = defaultPrefix
	}
	if err := coordination.ValidatePrefix(opts.Prefix, opts.ResourcePrefix); err != nil {
		return nil, err
	}
	if err := coordination.ValidateID(opts.ID); err != nil {
		return nil, err
	}
	if opts.LeaseTTL <= 0 {
		opts.LeaseTTL = DefaultLeaseTTL
	}
	if opts.LeaseTTL < 2*time.Second {
		return nil, fmt.Errorf("--cluster-lease-ttl %s is too short: etcd leases count in seconds; use at least 2s", opts.LeaseTTL)
	}
	if opts.DisagreementAlarm <= 0 {
		opts.DisagreementAlarm = DefaultDisagreementAlarm
	}
	if opts.RefreshInterval <= 0 {
		opts.RefreshInterval = DefaultRefreshInterval
	}
	if opts.KeyWritesFlushInterval <= 0 {
		opts.KeyWritesFlushInterval = defaultKeyWritesFlushInterval
	}
	if opts.Version == "" {
		opts.Version = moduleVersion()
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	opts.Events = events.OrNop(opts.Events)
	log := opts.Logger.WithName("cluster").WithValues("apiserverID", opts.ID)
	fence, handshake := newFence(opts.ID, opts.Clock.Now()), newHandshake(opts.ID)
	fence.SetPromotionGate(handshake)
	n := &Node{
		opts:      opts,
		log:       log,
		pub:       newPublisher(opts.Client, memberKey(opts.Prefix, opts.ID), opts.LeaseTTL, log),
		fence:     fence,
		handshake: handshake,
		alarm:     newDisagreementAlarm(opts.DisagreementAlarm, opts.Clock.Now()),
		keyWrites: newKeyWritesFlusher(opts.Client, opts.Prefix),
		notify:    make(chan struct{}, 1),
		// A loss or the end of a resynchronisation, noticed outside the loop.
		resyncChanged: make(chan struct{}, 1),
	}
	n.view = newView(opts.Client, opts.Prefix, log, opts.Clock, opts.LeaseTTL, n.viewStepped)
	return n, nil
}

func moduleVersion() string {
	if bi, ok := debug.ReadBuildInfo(); ok && bi.Main.Version != "" {
		return bi.Main.Version
	}
	return "(devel)"
}

// ID is this apiserver's id.
func (n *Node) ID() string { return n.opts.ID }

// Prefix is the coordination prefix.
func (n *Node) Prefix() string { return n.opts.Prefix }

// Members returns the live members sorted by id, as this apiserver's watch sees them
// (MigratorOptions.Members).
func (n *Node) Members() []MemberState { return n.view.Members() }

// MembersChanged is closed at the next change of the live member set
// (MigratorOptions.MembersChanged).
func (n *Node) MembersChanged() <-chan struct{} { return n.view.Changed() }

// Start loads the member list (so the fence knows who must read a key before the
// agent's first configuration is applied) and starts watching it.
func (n *Node) Start(ctx context.Context) error {
	lctx, cancel := context.WithTimeout(ctx, 2*etcdTimeout)
	defer cancel()
	id, err := EnsureIdentity(lctx, n.opts.Client, n.opts.Prefix, n.opts.ResourcePrefix, n.opts.ID, n.opts.Clock.Now())
	if err != nil {
		return fmt.Errorf("cluster coordination: %w", err)
	}
	n.mu.Lock()
	n.clusterID = id.ClusterID
	n.mu.Unlock()
	n.view.bindCluster(id.ClusterID)
	if err := n.view.Load(lctx); err != nil {
		return fmt.Errorf("cluster coordination: listing the members under %s: %w (check --etcd-servers, or pass --cluster-coordination=false for a single apiserver)", membersPrefix(n.opts.Prefix), err)
	}
	n.mu.Lock()
	// From now on a tick more than a lease TTL after the previous one is a pause.
	now := n.opts.Clock.Now()
	n.fence.SetLeaseTTL(n.opts.LeaseTTL, now)
	n.ticked.Store(&now)
	n.mu.Unlock()
	runCtx, stop := context.WithCancel(context.Background())
	n.cancel, n.done = stop, make(chan struct{})
	go func() {
		defer close(n.done)
		var wg sync.WaitGroup
		wg.Add(1)
		go func() { defer wg.Done(); n.view.Run(runCtx) }()
		wg.Add(1)
		go func() { defer wg.Done(); n.watchPauses(runCtx) }()
		n.run(runCtx)
		wg.Wait()
	}()
	return nil
}

// WriteFence is reload.Options.WriteFence: the fence decides with the members the
// watch has delivered (the watch steps them in as it receives them, see viewStepped),
// and the node logs and raises Events for what the decision changed.
func (n *Node) WriteFence(current, next []transformers.RuleInfo) map[string]transformers.Writer {
	n.mu.Lock()
	n.handshake.BeginDecision()
	d := n.fence.Decide(current, next)
	n.mu.Unlock()
	for _, h := range d.Released {
		n.log.V(2).Info("Write fence no longer holds a write key back", "resource", h.Resource, "held", h.Held.String())
	}
	for _, h := range d.Changed {
		if h.Refused != "" {
			msg := "Write fence refuses writes" // the reason says why
			if d.Resyncing {
				msg = resyncHoldMessage
			}
			n.log.Info(msg, "resource", h.Resource, "reason", h.Refused)
			n.opts.Events.Event(events.Warning, events.ReasonWritesRefused, fmt.Sprintf("%s: the write fence refuses writes: %s", h.Resource, h.Refused))
			continue
		}
		n.log.Info("Write fence holds a new write key back until every live apiserver can read it",
			"resource", h.Resource, "held", h.Held.String(), "writing", h.Writing.String(), "waitingFor", h.WaitingFor, "unsafe", h.Unsafe)
		n.opts.Events.Event(events.Normal, events.ReasonWriteKeyHeld, fmt.Sprintf("%s: the write fence holds %s back until every live apiserver can read it (waiting for %s); writing with %s",
			h.Resource, h.Held.String(), strings.Join(h.WaitingFor, ", "), h.Writing.String()))
	}
	return d.Writers
}

// Notify asks for the member state to be published now (reload.Options.OnChange and
// the KMS provider's key id hook). It never blocks.
func (n *Node) Notify() {
	select {
	case n.notify <- struct{}{}:
	default:
	}
}

// NotifyKeyID is kmsv2.FactoryOptions.OnKeyIDChange.
func (n *Node) NotifyKeyID(string, string) { n.Notify() }

// MayWriteKeyID is kmsv2.FactoryOptions.MayWriteKeyID, the write fence for KMS key
// ids: this apiserver's KMS provider may start writing under
// keyIDHash once every other live member with a provider of that name reports, in its
// member state, that its plugin can decrypt that key id. It never waits on etcd: it
// asks the fence, which the watch of the members feeds.
func (n *Node) MayWriteKeyID(provider, keyIDHash string) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.fence.MayWriteKeyID(provider, keyIDHash)
}

// Attach gives the node its agent (a *reload.Agent: the node publishes the agent's
// status and asks it to apply the fence again when the members change); publishing
// starts.
func (n *Node) Attach(a reloadAgent) {
	n.mu.Lock()
	n.agent = a
	n.mu.Unlock()
	n.Notify()
}

// SetMigrator lets the status document show the migration state.
func (n *Node) SetMigrator(m *Migrator) {
	n.mu.Lock()
	n.migrator = m
	n.mu.Unlock()
}

func (n *Node) run(ctx context.Context) {
	ticker := n.opts.Clock.NewTicker(tickInterval)
	defer ticker.Stop()
	// Taken before the loop and again before each read of the members, never at the
	// top of an iteration: a change while the loop publishes would close a channel
	// nobody holds any more, and the fence would miss it until the next change.
	changed := n.view.Changed()
	for {
		select {
		case <-ctx.Done():
			return
		case <-n.notify:
			n.publish(ctx, false)
		case <-n.pub.Lost():
			n.lose(leaseLost{At: n.opts.Clock.Now()})
			n.resync(ctx)
		case <-n.resyncChanged:
			n.resync(ctx)
		case <-changed:
			changed = n.view.Changed()
			n.membersChanged(ctx)
		case <-ticker.C():
			n.tick(ctx)
		}
	}
}

// membersChanged lets the agent promote (or hold) write keys: the watch has stepped
// the new members into the fence already (viewStepped).
func (n *Node) membersChanged(ctx context.Context) {
	n.mu.Lock()
	agent := n.agent
	n.mu.Unlock()
	if agent != nil {
		if err := agent.Refence(); err != nil {
			n.log.Error(err, "Could not apply the write fence's decision")
		}
		n.confirmPromotions(ctx)
	}
	n.evaluate()
}

// confirmPromotions does the promotion side of the handshake with members dropping
// keys (handshake): when the fence holds a key back only for want of it, it reads every
// member record — after this apiserver's record showing the key held, which publish
// put before — and lets the fence decide again.
func (n *Node) confirmPromotions(ctx context.Context) {
	n.mu.Lock()
	pending, agent := n.handshake.Pending(), n.agent
	n.mu.Unlock()
	if !pending || agent == nil {
		return
	}
	rctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	read, err := readMembers(rctx, n.opts.Client, n.opts.Prefix, n.ownClusterID())
	cancel()
	if err != nil {
		n.log.Error(err, "Cannot read the members to confirm a promotion; the key stays held and the read is tried again")
		return
	}
	n.mu.Lock()
	n.handshake.Read(read)
	n.mu.Unlock()
	if err := agent.Refence(); err != nil {
		n.log.Error(err, "Could not apply the write fence's decision")
	}
}

func (n *Node) tick(ctx context.Context) {
	now := n.opts.Clock.Now()
	n.mu.Lock()
	started := n.stepLocked(tick{Now: now})
	agent, due := n.agent, now.Sub(n.lastPublish) >= n.opts.RefreshInterval
	awaitsPut := n.fence.AwaitsPut()
	n.mu.Unlock()
	if agent == nil {
		return
	}
	if started || awaitsPut {
		// Hold the writes now, and publish until the record is back.
		n.resync(ctx)
	}
	// The cheap fallback for changes no hook reported (e.g. a KMS key id seen by a
	// read-only provider): compare the state we would publish with the published one.
	st := n.state(now)
	n.mu.Lock()
	stale := !sameContent(st, n.published)
	n.mu.Unlock()
	if stale || due {
		n.publish(ctx, due)
	} else {
		// A read to confirm a promotion that failed (etcd did not answer) is tried
		// again here, not only at the next change of the members.
		n.confirmPromotions(ctx)
	}
	n.flushKeyWrites(ctx, false)
	n.evaluate()
}

// state is this member's state now.
func (n *Node) state(now time.Time) MemberState {
	n.mu.Lock()
	agent, held, since, clusterID := n.agent, n.fence.HeldSince(), n.alarm.Since(), n.clusterID
	n.mu.Unlock()
	status := agent.OwnStatus()
	st := stateFromStatus(n.opts.ID, n.opts.Version, status, held, now)
	st.DisagreeingSince, st.ClusterID = since, clusterID
	st.StorageMigration = &StorageMigrationState{Resources: slices.Clone(n.opts.MigratesResources)}
	st.BackupRetention = n.opts.BackupRetention.String()
	st.KeyWrites = boundKeyWrites(status.KeyWrites, maxPublishedKeyWrites)
	return n.announced(st, status.ActiveConfigHash, status.LastAttemptAt, status.LastErrorAt)
}

func (n *Node) publish(ctx context.Context, force bool) {
	if err := n.publishNow(ctx, force); err == nil {
		n.confirmPromotions(ctx)
	}
}

// publishNow puts this member's state (unless it is unchanged and force is false) and
// returns when etcd has it.
func (n *Node) publishNow(ctx context.Context, force bool) error {
	n.publishMu.Lock()
	defer n.publishMu.Unlock()
	n.mu.Lock()
	agent := n.agent
	n.mu.Unlock()
	if agent == nil {
		return nil
	}
	now := n.opts.Clock.Now()
	st := n.state(now)
	n.mu.Lock()
	same := sameContent(st, n.published) && n.publishErr == ""
	n.mu.Unlock()
	if same && !force {
		return nil
	}
	pctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	n.mu.Lock()
	losses := n.fence.Losses() // before the Put: a loss after it voids it
	n.mu.Unlock()
	rev, err := n.publishAttempts(pctx, st)
	n.mu.Lock()
	defer n.mu.Unlock()
	if err != nil {
		if n.publishErr == "" {
			n.log.Error(err, "Cannot publish this apiserver's encryption state; retrying")
		}
		n.publishErr = err.Error()
		if n.publishFailingSince.IsZero() {
			n.publishFailingSince = now
		}
		return err
	}
	n.publishErr, n.published, n.lastPublish, n.publishFailingSince = "", st, now, time.Time{}
	n.handshake.Published(st)
	n.stepLocked(recordPut{Rev: rev, Losses: losses})
	return nil
}

// publishAttempt bounds one attempt to publish; publishAttempts tries again until
// ctx ends. A Put that a follower forwarded to an etcd leader killed meanwhile waits for
// etcd's 7 s request timeout, while a new leader answers one sent a second or two
// later: a single attempt under the 5 s publish timeout blocked the node's loop (and
// the promotion handshake behind it) for all of that in every leader loss.
const (
	publishAttempt      = 1500 * time.Millisecond
	publishRetryBackoff = 100 * time.Millisecond
)

// publishAttempts publishes st, trying again while etcd does not answer (an attempt's
// deadline, a leader election) and ctx lasts; any other failure is returned at once.
func (n *Node) publishAttempts(ctx context.Context, st MemberState) (int64, error) {
	for {
		actx, cancel := context.WithTimeout(ctx, publishAttempt)
		rev, err := n.pub.Publish(actx, st)
		cancel()
		if err == nil || ctx.Err() != nil || !etcdunavailable.Is(err) {
			return rev, err
		}
		// Real time, as the attempts' deadlines: a test's fake clock does not move etcd.
		t := time.NewTimer(publishRetryBackoff)
		select {
		case <-ctx.Done():
			t.Stop()
			return rev, err
		case <-t.C:
		}
	}
}

// evaluate feeds the disagreement alarm and updates the metrics.
func (n *Node) evaluate() {
	now := n.opts.Clock.Now()
	members := n.view.Members()
	n.mu.Lock()
	attached := n.agent != nil
	n.mu.Unlock()
	var self MemberState
	if attached {
		// This apiserver's own state as it is now, not as last published.
		self = n.state(now)
		members = append(slices.DeleteFunc(members, func(m MemberState) bool { return m.APIServerID == n.opts.ID }), self)
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	wasRaised := n.alarm.Raised()
	n.alarm.Step(tick{Now: now})
	n.alarm.Step(membersChanged{Members: members})
	alarm := n.alarm.Raised()
	if alarm && !wasRaised {
		n.log.Error(nil, "ALARM: the apiservers have disagreed about a write key for too long",
			"since", n.alarm.Since(), "threshold", n.opts.DisagreementAlarm, "detail", n.alarm.Detail())
		n.opts.Events.Event(events.Warning, events.ReasonDisagreement, fmt.Sprintf("the apiservers have disagreed about a write key since %s (longer than %s, or two secrets under one key name): %s",
			n.alarm.Since().UTC().Format(time.RFC3339), n.opts.DisagreementAlarm, n.alarm.Detail()))
	}
	if attached {
		for _, e := range n.edges.step(n.opts.ID, members) {
			n.opts.Events.Event(e.kind, e.reason, e.message)
		}
	}
	if m := n.opts.Metrics; m != nil {
		m.members.Set(float64(len(members)))
		var st *MigrationState
		if n.migrator != nil {
			s, leading := n.migrator.State()
			st = &s
			m.leader.Set(b2f(leading))
			m.migrationObj.Reset()
			if s.Progress != nil {
				m.migrationObj.WithLabelValues(s.Progress.Resource, "done").Set(float64(s.Progress.Done))
				m.migrationObj.WithLabelValues(s.Progress.Resource, "total").Set(float64(s.Progress.Total))
			}
		}
		m.converged.Set(b2f(Evaluate(members, st, now, n.opts.DisagreementAlarm).Converged))
		m.alarm.Set(b2f(alarm))
		m.fenceHeld.Reset()
		for _, h := range n.fence.Holds() {
			m.fenceHeld.WithLabelValues(h.Resource).Set(now.Sub(h.Since).Seconds())
		}
		for _, h := range n.fence.KeyIDHolds(self) {
			m.fenceHeld.WithLabelValues(h.Resource).Set(now.Sub(h.Since).Seconds())
		}
	}
}

// Close stops the loops and revokes the member lease, so the other apiservers stop
// counting this one at once.
func (n *Node) Close() {
	if n.cancel != nil {
		n.cancel()
		<-n.done
	}
	ctx, cancel := context.WithTimeout(context.Background(), etcdTimeout)
	defer cancel()
	// The writes since the last flush, so a clean restart loses none of the total.
	n.flushKeyWrites(ctx, true)
	if err := n.pub.Close(ctx); err != nil {
		n.log.Error(err, "Could not revoke the member lease; the member key expires with it")
	}
}

// Holds lists the write keys this apiserver's fence holds back, and the KMS key ids
// its providers hold back (Held.KeyIDHash set, the same entry as Writing).
func (n *Node) Holds() []Hold {
	n.mu.Lock()
	attached := n.agent != nil
	n.mu.Unlock()
	var self MemberState
	if attached {
		self = n.state(time.Time{})
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	return append(slices.Clone(n.fence.Holds()), n.fence.KeyIDHolds(self)...)
}

// viewStepped is the view's callback: every list and watch response is stepped into
// the fence as it arrives, so that a decision is always taken with the members the
// watch has delivered (a member that just appeared must not miss a promotion) without
// the queries stepping the fence themselves.
func (n *Node) viewStepped(ev membersChanged) {
	n.mu.Lock()
	n.stepLocked(ev)
	n.mu.Unlock()
}

// ownClusterID is the cluster identity Start read or created.
func (n *Node) ownClusterID() string {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.clusterID
}

// The resynchronisation after a lost lease or a pause (fence_resync.go): the Node steps
// the losses, its record's Puts, the views and the ticks into the fence, applies the
// fence again when a resynchronisation starts or ends, and publishes its record until
// it is back. Readiness fails meanwhile (clusterViewFailure).

// resyncHoldMessage is the log line of every write the fence holds to resynchronise.
const resyncHoldMessage = "Holding every write until this apiserver is back in the cluster's view"

// watchPauses steps the fence's clock every tickInterval on a goroutine that never
// waits on etcd, so that a pause longer than the lease TTL is noticed as soon as the
// process runs again, even while the loop waits on etcd, and the writes are held at
// once.
func (n *Node) watchPauses(ctx context.Context) {
	t := n.opts.Clock.NewTicker(tickInterval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
		now := n.opts.Clock.Now()
		n.mu.Lock()
		lost := n.stepLocked(tick{Now: now})
		agent := n.agent
		n.mu.Unlock()
		// Stored after the fence stepped: the gate opens only once the fence holds.
		n.ticked.Store(&now)
		if lost && agent != nil {
			if err := agent.Refence(); err != nil {
				n.log.Error(err, "Could not apply the write fence's decision")
			}
		}
	}
}

// WriteGate is reload.Options.WriteGate: it refuses every write while the clock has run
// more than a lease TTL past watchPauses' last step. After a pause (SIGSTOP, a VM
// frozen) a request can be served before watchPauses runs again and the fence holds
// the writes; this apiserver may have been dropped by the others meanwhile, and they
// may have dropped its write key. The refusal ends at the next step (at most a
// tickInterval), when the fence takes over.
func (n *Node) WriteGate() error {
	last := n.ticked.Load()
	if last == nil {
		return nil
	}
	if gap := n.opts.Clock.Since(*last); gap > n.opts.LeaseTTL {
		return &transformers.WriteRefusedError{RetryAfter: tickInterval, Reason: fmt.Sprintf(
			"writes are held: this apiserver did not run for %s, longer than its %s member lease (a paused process or VM, or a starved one); they resume once it has checked its place in the cluster again",
			gap.Round(time.Millisecond), n.opts.LeaseTTL)}
	}
	return nil
}

// lose steps a lost lease into the fence.
func (n *Node) lose(ev leaseLost) {
	n.mu.Lock()
	n.stepLocked(ev)
	n.mu.Unlock()
}

// stepLocked steps one event into the fence (n.mu held) and acts on what the fence
// says changed; it reports whether a loss began. After a loss, confirmations of
// promotions are withdrawn (while this apiserver had no record, a member dropping a
// key could read the members without seeing it) and the loop is asked to hold the
// writes and publish; after a resynchronisation, the loop is asked to apply the fence
// again so that writes resume.
func (n *Node) stepLocked(ev fenceEvent) (lost bool) {
	n.fence.Step(ev)
	r := n.fence.Ready()
	if r.Lost {
		n.handshake.RecordLost()
		_, _, why := n.fence.Resync()
		n.log.Info(resyncHoldMessage, "reason", why)
		n.signalResync()
	}
	if r.Resynced {
		n.log.Info("Back in the cluster's view: this apiserver's record is published again and its view includes it; the write fence decides again",
			"heldFor", n.opts.Clock.Since(r.HeldSince).Round(time.Millisecond), "viewRevision", n.fence.viewRev)
		n.signalResync()
	}
	return r.Lost
}

// signalResync asks the loop to resync; it never blocks.
func (n *Node) signalResync() {
	select {
	case n.resyncChanged <- struct{}{}:
	default:
	}
}

// resync applies the fence again (holding or releasing every write) and, while the
// fence waits for this apiserver's record, publishes it.
func (n *Node) resync(ctx context.Context) {
	n.mu.Lock()
	agent, awaitsPut := n.agent, n.fence.AwaitsPut()
	n.mu.Unlock()
	if agent == nil {
		return
	}
	if err := agent.Refence(); err != nil {
		n.log.Error(err, "Could not apply the write fence's decision")
	}
	if awaitsPut {
		n.publish(ctx, true)
	}
}

// clusterViewFailure is why readiness fails while this apiserver cannot trust its
// picture of the others: its view of the members was last known current more than a
// lease TTL ago, or its fence holds every write to resynchronise.
func (n *Node) clusterViewFailure() error {
	now := n.opts.Clock.Now()
	if fresh := n.view.FreshAt(); !fresh.IsZero() && now.Sub(fresh) > n.opts.LeaseTTL {
		return fmt.Errorf("this apiserver's view of the live apiservers under %s was last known current %s ago, longer than its %s lease: the others may have changed keys since; "+
			"waiting for the watch to catch up (check the connection to etcd)", membersPrefix(n.opts.Prefix), now.Sub(fresh).Round(time.Millisecond), n.opts.LeaseTTL)
	}
	n.mu.Lock()
	held, since, why := n.fence.Resync()
	n.mu.Unlock()
	if held {
		return fmt.Errorf("this apiserver holds every write since %s: %s; waiting until its member record is published again and its view of the other apiservers includes it",
			since.UTC().Format(time.RFC3339), why)
	}
	return nil
}
