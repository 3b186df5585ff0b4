package cluster

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// MigratorOptions configure a Migrator.
type MigratorOptions struct {
	Client *clientv3.Client
	Prefix string
	ID     string
	// SessionTTL is the election session's lease (the leader fails over this long after
	// it dies).
	SessionTTL time.Duration
	Resources  []migrate.Resource
	// CurrentResources, when set, replaces Resources and is asked at every round (a
	// wildcard rule's resources are found in etcd and change as objects are stored).
	CurrentResources func() []migrate.Resource
	Source           migrate.Source
	// Inventory is the local inventory store: its inventories feed the leader, and the
	// verifying re-scans of migrations land in it (for the key-in-use guard).
	Inventory *migrate.InventoryStore
	Metrics   *migrate.Metrics
	Rate      float64
	// Space bounds how full the migration lets etcd's database get.
	Space pace.SpaceOptions
	// Pacing tunes the adaptive rate (its Ceiling is Rate): its Serving is this
	// apiserver's own request latency.
	Pacing pace.Options
	// ConfigHash returns the active configuration's hash (recorded in inventories).
	ConfigHash func() string
	// Members returns the live members; MembersChanged is closed when they change.
	Members        func() []MemberState
	MembersChanged func() <-chan struct{}
	Logger         klog.Logger
	Clock          clock.WithTicker
	// Events receives migration started, verified and failed (events.Nop by default);
	// Mirror, when set, is told of each migration too (see MigrationMirror).
	Events events.Sink
	Mirror MigrationMirror
}

// Migrator runs storage migration on one elected apiserver: it campaigns on
// <prefix>/migration/leader, and while it leads, lets a pure decision machine choose
// what to migrate, runs migrate.Migrate with its checkpoint in etcd, and keeps
// MigrationState current.
// On the other apiservers it follows the state in etcd for the status document.
type Migrator struct {
	opts MigratorOptions
	log  klog.Logger

	mu      sync.Mutex
	leading bool
	state   MigrationState
	// loaded is set once state was read from etcd or set by the leader; stateErr is why
	// the state in etcd is unknown now (unreadable or undecodable). See knownState.
	loaded   bool
	stateErr error
	last     *migrate.MigrationRecord
	// resume is where the previous resource's migration left the pacer.
	resume resumeRate
}

// resumeRate is the rate a resource's migration ended at, for the next resource of the
// same rotation when it starts within resumeRateFor.
type resumeRate struct {
	target Key
	rate   float64
	at     time.Time
	// clients is what that migration judged of the clients within its horizon: the
	// next one's allowance of slow requests goes on from it.
	clients pace.ClientsHorizon
}

// resumeRateFor: a rate older than this says little about the clients now.
const resumeRateFor = 30 * time.Second

// knownRate is the sustained rate of the latest migration on record that had one (0:
// none): where the next starts (pace.Options.KnownRate). It is kept in the migration
// state, so a new leader and the next rotation, weeks later, start from it too; the
// pacer starts at half of it and halves again at the first slowed window.
func knownRate(records map[string]Record) float64 {
	var latest Record
	for _, r := range records {
		if r.SustainedRate > 0 && r.FinishedAt.After(latest.FinishedAt) {
			latest = r
		}
	}
	return latest.SustainedRate
}

// LastMigration is the latest migration this apiserver ran as leader, in the storage
// controller's format (nil when none).
func (m *Migrator) LastMigration() *migrate.MigrationRecord {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.last == nil {
		return nil
	}
	r := *m.last
	return &r
}

// NewMigrator returns a Migrator; call Run.
func NewMigrator(opts MigratorOptions) *Migrator {
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	if opts.SessionTTL <= 0 {
		opts.SessionTTL = DefaultLeaseTTL
	}
	if opts.ConfigHash == nil {
		opts.ConfigHash = func() string { return "" }
	}
	if opts.Inventory == nil {
		opts.Inventory = &migrate.InventoryStore{}
	}
	opts.Events = events.OrNop(opts.Events)
	return &Migrator{opts: opts, log: opts.Logger.WithName("cluster-migrator")}
}

// State returns the latest migration state (the leader's own, or as read from etcd).
func (m *Migrator) State() (MigrationState, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := m.state
	st.Records = make(map[string]Record, len(m.state.Records))
	for k, v := range m.state.Records {
		st.Records[k] = v
	}
	return st, m.leading
}

// InventoriesTo reports whether this migrator is about to leave this apiserver's
// inventory of resource under the write target whose stored prefix is prefix (and, for
// KMS v2, whose key id hash is keyIDHash): the leader is migrating it to that target
// now, or has verified that and refreshInventory has not yet adopted the re-scan. The
// storage controller then takes no inventory of its own for the write-key change
// (migrate.ControllerOptions.InventoriedElsewhere): a scan of every object while the
// leader rewrites them costs the clients, and the leader's pacing, for counts that
// are stale within seconds.
func (m *Migrator) InventoriesTo(resource, prefix, keyIDHash string) bool {
	st, _ := m.State()
	same := func(k Key) bool { return k.StoredPrefix() == prefix && k.KeyIDHash == keyIDHash }
	if r := st.Running; r != nil && r.Resource == resource && same(r.Target) {
		return true
	}
	rec, ok := st.Records[resource]
	return ok && same(rec.Target) && inventoryBehind(m.opts.Inventory.Latest(), resource, rec)
}

// inventoryBehind reports whether inv's count of resource was read before rec, a
// verified migration of it with a revision: refreshInventory replaces it.
func inventoryBehind(inv *migrate.Inventory, resource string, rec Record) bool {
	if !rec.Verified || rec.Revision == 0 {
		return false
	}
	ri := inv.Find(resource)
	return ri == nil || ri.Revision < rec.Revision
}

// Run campaigns and leads until ctx ends.
func (m *Migrator) Run(ctx context.Context) {
	e := &elector{client: m.opts.Client, key: coordination.MigrationLeader(m.opts.Prefix), id: m.opts.ID, ttl: m.opts.SessionTTL, clock: m.opts.Clock, log: m.log}
	e.Run(ctx, electionCallbacks{OnStartedLeading: m.lead, WhileFollowing: m.follow})
}

func (m *Migrator) setState(st MigrationState) {
	m.mu.Lock()
	m.state, m.loaded, m.stateErr = st, true, nil
	m.mu.Unlock()
}

func (m *Migrator) setLeading(leading bool) {
	m.mu.Lock()
	m.leading = leading
	m.mu.Unlock()
}

type migrationResult struct {
	mig          Migration
	err          error
	revision     int64
	acknowledged int64
	sustained    float64
	pacedBy      []string
}

// term is the leader's work during one term of leadership: the leader machine fed from
// the member view, the inventory and the migrations it starts, one at a time.
type term struct {
	m        *Migrator
	guard    []clientv3.Cmp
	leader   *leader
	state    *statePublisher
	results  chan migrationResult
	running  bool
	progress atomic.Pointer[Progress]
}

// lead is the election's OnStartedLeading: it runs until ctx ends (the session ended)
// or a guarded write finds the leadership gone, and stops the running migration then.
// Until it has read the stored state (or found none), it starts no migration and
// publishes nothing (see loadRecords).
func (m *Migrator) lead(ctx context.Context, guard []clientv3.Cmp) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	m.log.Info("Elected storage migration leader", "apiserverID", m.opts.ID)
	m.setLeading(true)
	defer m.setLeading(false)
	records, ok := m.loadRecords(ctx)
	if !ok {
		return
	}
	t := m.newTerm(ctx, guard, records)
	defer func() { cancel(); t.awaitRunning() }()
	ticker := m.opts.Clock.NewTicker(time.Second)
	defer ticker.Stop()
	for {
		membersChanged := m.opts.MembersChanged()
		if err := t.round(ctx); errors.Is(err, errNotLeader) {
			m.log.Info("Lost the migration leadership")
			return
		}
		select {
		case <-ctx.Done():
			return
		case r := <-t.results:
			t.finished(r)
		case <-membersChanged:
		case <-ticker.C():
		}
	}
}

// resources are the resources to migrate now.
func (m *Migrator) resources() []migrate.Resource {
	if m.opts.CurrentResources != nil {
		return m.opts.CurrentResources()
	}
	return m.opts.Resources
}

func resourceNames(rs []migrate.Resource) []string {
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.String()
	}
	return names
}

// State reading: a newly elected leader that cannot read or decode the stored state
// tries again after stateReadRetry, doubling up to stateReadRetryMax.
const (
	stateReadRetry    = 500 * time.Millisecond
	stateReadRetryMax = 15 * time.Second
)

// loadRecords reads the stored migration state for a newly elected leader: its records
// (none when no state is stored). The records are what the cluster knows of verified
// migrations, and the leader's first publish replaces the stored state, so while the
// state cannot be read (etcd fails) or does not decode, loadRecords retries with backoff
// and never returns without it; ok is false when ctx ended first (the term is over).
// Meanwhile the state counts as unknown (knownState: the guard refuses drops). A state
// that does not decode is left as it is (it may be a newer rekey's, or repairable): the
// error and an event say so and what an operator can do.
func (m *Migrator) loadRecords(ctx context.Context) (records map[string]Record, ok bool) {
	key := migrationStateKey(m.opts.Prefix)
	delay, warned := stateReadRetry, false
	for {
		st, rev, err := m.getState(ctx)
		if err == nil {
			return st.Records, true
		}
		if ctx.Err() != nil {
			return nil, false
		}
		m.setStateUnknown(err)
		if rev == 0 {
			m.log.Error(err, "Cannot read the migration state; this migration leader starts no migration and publishes no state until it has read it, and retries (check that etcd answers)", "key", key, "retryIn", delay)
		} else {
			cause := err
			if inner := errors.Unwrap(err); inner != nil {
				cause = inner
			}
			msg := fmt.Sprintf("the stored migration state at %s does not decode (%s): the migration leader does not overwrite it and starts no migration until it decodes; "+
				"restore it, or delete it (etcdctl del %s) to start from no records (every resource is then migrated and verified again)", key, errtext.Bounded(cause, errtext.MaxPublished), key)
			m.log.Error(nil, "Storage migration held: "+msg, "retryIn", delay)
			if !warned {
				m.opts.Events.Event(events.Warning, events.ReasonMigrationFailed, "Storage migration held: "+msg)
				warned = true
			}
		}
		wait(ctx, m.opts.Clock, delay)
		if ctx.Err() != nil {
			return nil, false
		}
		delay = min(2*delay, stateReadRetryMax)
	}
}

func (m *Migrator) newTerm(ctx context.Context, guard []clientv3.Cmp, records map[string]Record) *term {
	l := newLeader(resourceNames(m.resources()), m.opts.Clock.Now())
	l.Step(recordsLoaded{Records: records})
	l.Step(leadership{Leading: true})
	return &term{m: m, guard: guard, leader: l, results: make(chan migrationResult, 1),
		state: &statePublisher{client: m.opts.Client, key: migrationStateKey(m.opts.Prefix), guard: guard}}
}

// round feeds the leader what changed, starts the migration it asks for, and
// publishes the state; it returns the publishing error.
func (t *term) round(ctx context.Context) error {
	m, l := t.m, t.leader
	now := m.opts.Clock.Now()
	l.Step(tick{Now: now})
	l.Step(resourcesChanged{Resources: resourceNames(m.resources())})
	l.Step(membersChanged{Members: m.opts.Members()})
	for _, ev := range inventoryEvents(m.opts.Inventory.Latest()) {
		l.Step(ev)
	}
	if mig, ok := l.Ready(); ok {
		l.Step(migrationStarted{Migration: mig})
		t.start(ctx, mig)
	}
	st := MigrationState{Leader: m.opts.ID, Records: l.Records(), Plans: l.Plans(), UpdatedAt: now}
	if mig, ok := l.Running(); ok {
		st.Running, st.Progress = &mig, t.progress.Load()
	}
	m.setState(st)
	m.refreshInventory(ctx, st.Records)
	return t.state.publish(st, t.running)
}

func (t *term) start(ctx context.Context, mig Migration) {
	t.running = true
	t.m.log.Info("Every live apiserver writes with the same key; migrating stored objects", "resource", mig.Resource, "target", mig.Target.String())
	t.m.opts.Events.Event(events.Normal, events.ReasonMigrationStarted, fmt.Sprintf("%s: every live apiserver writes with %s; migrating stored objects to it", mig.Resource, mig.Target.String()))
	mirror := t.m.opts.Mirror
	known := knownRate(t.leader.Records())
	go func() {
		if mirror != nil {
			mirror.Started(ctx, mig.Resource, mig.Target.String())
		}
		out := t.m.migrate(ctx, mig, known, t.guard, func(p Progress) { t.progress.Store(&p) })
		out.mig = mig
		if mirror != nil {
			// Told even when the leadership ended (ctx cancelled): the mirror must not
			// stay Running for a migration this term no longer runs.
			mirror.Finished(context.WithoutCancel(ctx), mig.Resource, out.err)
		}
		t.results <- out
	}()
}

func (t *term) finished(r migrationResult) {
	t.running = false
	t.progress.Store(nil)
	errText := ""
	if r.err != nil {
		errText = r.err.Error()
		t.m.log.Error(r.err, "Storage migration failed; the leader retries", "resource", r.mig.Resource)
		t.m.opts.Events.Event(events.Warning, events.ReasonMigrationFailed, fmt.Sprintf("%s: storage migration to %s failed; the leader retries: %s",
			r.mig.Resource, r.mig.Target.String(), errtext.Bounded(r.err, errtext.MaxPublished)))
	} else {
		t.m.log.Info("Storage migration verified", "resource", r.mig.Resource, "target", r.mig.Target.String())
		msg := fmt.Sprintf("%s: every stored object is now under %s (verified by a re-scan)", r.mig.Resource, r.mig.Target.String())
		if r.acknowledged > 0 {
			msg = fmt.Sprintf("%s: every stored object is now under %s, except %d acknowledged unreadable (verified by a re-scan)", r.mig.Resource, r.mig.Target.String(), r.acknowledged)
		}
		t.m.opts.Events.Event(events.Normal, events.ReasonMigrationVerified, msg)
	}
	t.leader.Step(tick{Now: t.m.opts.Clock.Now()})
	t.leader.Step(migrationFinished{Resource: r.mig.Resource, Target: r.mig.Target, Err: errText, Revision: r.revision, Acknowledged: r.acknowledged, SustainedRate: r.sustained, PacedBy: r.pacedBy})
}

// awaitRunning waits for the running migration (its context is cancelled) to return.
func (t *term) awaitRunning() {
	if t.running {
		<-t.results
	}
}

// refreshInventory takes a fresh inventory of every resource whose local inventory was
// read before its latest verified migration (a follower's, or one the local controller
// took while the leader migrated), so that the guards and readiness stop counting objects
// under keys the migration left. It reports false when an inventory it needed failed
// (to be retried).
func (m *Migrator) refreshInventory(ctx context.Context, records map[string]Record) bool {
	if m.opts.Source == nil {
		return true
	}
	latest := m.opts.Inventory.Latest()
	var stale []migrate.Resource
	for _, r := range m.resources() {
		if rec, ok := records[r.String()]; ok && inventoryBehind(latest, r.String(), rec) {
			stale = append(stale, r)
		}
	}
	// The leader's re-scan, when this apiserver classifies as it did, saves reading
	// every object again (see verified.go).
	var scan []migrate.Resource
	for _, r := range stale {
		inv, why := adoptVerified(ctx, m.opts.Client, m.opts.Prefix, r.String(), records[r.String()], m.opts.ConfigHash())
		if inv == nil {
			m.log.V(2).Info("Taking an inventory after a cluster migration: the leader's re-scan cannot be adopted", "resource", r.String(), "reason", why)
			scan = append(scan, r)
			continue
		}
		m.log.V(2).Info("Adopted the leader's verifying re-scan as this apiserver's inventory", "resource", r.String(), "revision", inv.Resources[0].Revision)
		m.opts.Metrics.RecordInventory(inv)
		m.opts.Inventory.Set(mergeInventory(m.opts.Inventory.Latest(), inv))
	}
	if len(scan) == 0 {
		return true
	}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: m.opts.Client, Source: m.opts.Source, Resources: scan,
		ConfigHash: m.opts.ConfigHash(), CoordinationPrefix: m.opts.Prefix, Metrics: m.opts.Metrics, Clock: m.opts.Clock})
	if err != nil {
		m.log.V(2).Info("Inventory after a cluster migration failed; retrying", "err", err)
		return false
	}
	m.opts.Inventory.Set(mergeInventory(m.opts.Inventory.Latest(), inv))
	return true
}

// migrate runs one resource's migration with its checkpoint in etcd; its result has the
// etcd revision of the verifying re-scan, or, when it ended before one, the revision
// when it ended: what orders the record against inventories.
func (m *Migrator) migrate(ctx context.Context, mig Migration, known float64, guard []clientv3.Cmp, report func(Progress)) migrationResult {
	var resource migrate.Resource
	for _, r := range m.resources() {
		if r.String() == mig.Resource {
			resource = r
		}
	}
	start := m.opts.Clock.Now()
	verified := &migrate.InventoryStore{}
	pacing := m.opts.Pacing
	pacing.KnownRate = known
	if pacing.Serving != nil {
		// Inside an apiserver: the other apiservers' clients count too.
		wctx, cancel := context.WithCancel(ctx)
		defer cancel()
		pacing.Members = watchMemberClients(wctx, m.opts.Client, m.opts.Prefix, m.opts.ID, m.log)
	}
	m.mu.Lock()
	if r := m.resume; r.target == mig.Target && m.opts.Clock.Since(r.at) < resumeRateFor {
		pacing.ResumeRate, pacing.ResumeHorizon = r.rate, r.clients
	}
	m.mu.Unlock()
	res, err := migrate.Migrate(ctx, migrate.Options{
		Client: m.opts.Client, Source: m.opts.Source, Resources: []migrate.Resource{resource}, Rate: m.opts.Rate, Space: m.opts.Space,
		Pacing:      pacing,
		Checkpoints: &etcdCheckpoints{Client: m.opts.Client, Key: coordination.MigrationCheckpoint(m.opts.Prefix), Guard: guard},
		Resume:      true, Inventory: verified, Metrics: m.opts.Metrics, ConfigHash: m.opts.ConfigHash(), Logger: m.opts.Logger,
		CoordinationPrefix: m.opts.Prefix,
		Progress: func(p migrate.Progress) {
			pr := Progress{Resource: mig.Resource, Phase: p.Phase, Pass: p.Pass, Done: p.Done, Total: p.Total, AllowedRate: p.AllowedRate, SlowedBy: p.SlowedBy, PacedBy: m.apiservers(p.ClientsOf)}
			if p.Paused.Reason != "" {
				pr.Paused = &p.Paused
			}
			if el := m.opts.Clock.Since(start).Seconds(); el > 0 {
				pr.Rate = float64(p.Scanned) / el
				if pr.Rate > 0 && p.Total > p.Done {
					pr.ETA = time.Duration(float64(p.Total-p.Done) / pr.Rate * float64(time.Second))
				}
			}
			report(pr)
		},
	})
	var out migrationResult
	if inv := verified.Latest(); inv != nil {
		m.opts.Inventory.Set(mergeInventory(m.opts.Inventory.Latest(), inv))
		if ri := inv.Find(mig.Resource); ri != nil {
			out.revision, out.acknowledged = ri.Revision, ri.Acknowledged
		}
		if err == nil {
			// Before the record says verified, so that a follower finds it there.
			if perr := publishVerified(m.opts.Client, m.opts.Prefix, mig.Resource, inv, guard); perr != nil {
				m.log.V(2).Info("Cannot share the verifying re-scan; each follower reads the resource itself", "resource", mig.Resource, "err", perr)
			}
		}
	}
	if out.revision == 0 {
		out.revision = m.currentRevision(ctx)
	}
	rec := &migrate.MigrationRecord{Resources: []string{mig.Resource}, Finished: m.opts.Clock.Now(), Acknowledged: out.acknowledged}
	if res != nil {
		rec.Duration, rec.Counters = res.Duration, res.Counters
		out.sustained = res.SustainedRate
		out.pacedBy = m.apiservers(res.ClientsOf)
		m.mu.Lock()
		m.resume = resumeRate{target: mig.Target, rate: res.AllowedRate, at: rec.Finished, clients: res.ClientsHorizon}
		m.mu.Unlock()
	}
	if err != nil {
		rec.Error = err.Error()
	}
	m.mu.Lock()
	m.last = rec
	m.mu.Unlock()
	if err != nil {
		out.err = fmt.Errorf("migrating %s to %s: %w", mig.Resource, mig.Target, err)
	}
	return out
}

// apiservers names pace's ClientsOf as apiserver ids ("" is this one).
func (m *Migrator) apiservers(clientsOf []string) []string {
	out := make([]string, 0, len(clientsOf))
	for _, id := range clientsOf {
		if id == "" {
			id = m.opts.ID
		}
		out = append(out, id)
	}
	return out
}

// currentRevision is etcd's revision now, or 0 when etcd does not answer (the record
// then counts as older than any inventory, the conservative side).
func (m *Migrator) currentRevision(ctx context.Context) int64 {
	ctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), etcdTimeout)
	defer cancel()
	resp, err := m.opts.Client.Get(ctx, migrationStateKey(m.opts.Prefix), clientv3.WithCountOnly())
	if err != nil {
		return 0
	}
	return resp.Header.Revision
}

// mergeInventory replaces older's resources that newer covers.
func mergeInventory(older, newer *migrate.Inventory) *migrate.Inventory {
	if older == nil {
		return newer
	}
	out := *older
	out.Resources = nil
	seen := map[string]bool{}
	for _, ri := range older.Resources {
		if n := newer.Find(ri.Resource); n != nil {
			out.Resources = append(out.Resources, *n)
		} else {
			out.Resources = append(out.Resources, ri)
		}
		seen[ri.Resource] = true
	}
	for _, ri := range newer.Resources {
		if !seen[ri.Resource] {
			out.Resources = append(out.Resources, ri)
		}
	}
	out.TakenAt = newer.TakenAt
	return &out
}

// inventoryEvents turns an inventory into the leader's inputs.
func inventoryEvents(inv *migrate.Inventory) []leaderEvent {
	if inv == nil {
		return nil
	}
	var out []leaderEvent
	for _, ri := range inv.Resources {
		ev := inventoryTaken{Resource: ri.Resource, Revision: ri.Revision, TakenAt: inv.TakenAt}
		for _, c := range ri.Buckets {
			// Acknowledged unreadable objects stay where they are: no migration moves
			// them, so they must not make one due.
			if n := c.Objects - c.Acknowledged; n > 0 {
				ev.Objects = append(ev.Objects, keyCount{Key: Key{Provider: c.Provider, Key: c.Key, KeyIDHash: c.KeyIDHash}, Objects: n})
			}
		}
		out = append(out, ev)
	}
	return out
}
