package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/migrate"
)

// MigrationState is what the migration leader keeps at <prefix>/migration/state: the
// record of every resource's latest migration and the progress of the running one.
type MigrationState struct {
	Leader    string            `json:"leader,omitempty"`
	Records   map[string]Record `json:"records"`
	Running   *Migration        `json:"running,omitempty"`
	Progress  *Progress         `json:"progress,omitempty"`
	Plans     []Plan            `json:"plans,omitempty"`
	UpdatedAt time.Time         `json:"updatedAt"`
}

// Progress is the running migration's progress.
type Progress struct {
	Resource string `json:"resource"`
	Phase    string `json:"phase"`
	Pass     int    `json:"pass"`
	Done     int64  `json:"done"`
	Total    int64  `json:"total"`
	// Rate is objects handled per second so far; ETA the estimated time left.
	Rate float64       `json:"ratePerSecond"`
	ETA  time.Duration `json:"eta"`
}

// MigratorOptions configure a Migrator.
type MigratorOptions struct {
	Client *clientv3.Client
	Prefix string
	ID     string
	// SessionTTL is the election session's lease (the leader fails over this long after
	// it dies).
	SessionTTL time.Duration
	Resources  []migrate.Resource
	Source     migrate.Source
	// Inventory is the local inventory store: its inventories feed the leader, and the
	// verifying re-scans of migrations land in it (for the key-in-use guard).
	Inventory *migrate.InventoryStore
	Metrics   *migrate.Metrics
	Rate      float64
	// ConfigHash returns the active configuration's hash (recorded in inventories).
	ConfigHash func() string
	// Members returns the live members; MembersChanged is closed when they change.
	Members        func() []MemberState
	MembersChanged func() <-chan struct{}
	Logger         klog.Logger
	Clock          clock.WithTicker
}

// Migrator runs storage migration on one elected apiserver: it campaigns on
// <prefix>/migration/leader, and while it leads, lets Leader decide what to migrate,
// runs migrate.Migrate with its checkpoint in etcd, and keeps MigrationState current.
// On the other apiservers it follows the state in etcd for the status document.
type Migrator struct {
	opts MigratorOptions
	log  klog.Logger

	mu      sync.Mutex
	leading bool
	state   MigrationState
	last    *migrate.MigrationRecord
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

// Run campaigns and leads until ctx ends.
func (m *Migrator) Run(ctx context.Context) {
	for ctx.Err() == nil {
		session, err := concurrency.NewSession(m.opts.Client, concurrency.WithTTL(int(m.opts.SessionTTL/time.Second)), concurrency.WithContext(ctx))
		if err != nil {
			m.log.Error(err, "Cannot open an election session; retrying")
			sleep(ctx, time.Second)
			continue
		}
		el := concurrency.NewElection(session, LeaderKey(m.opts.Prefix))
		campaign, stop := context.WithCancel(ctx)
		followDone := make(chan struct{})
		go func() { defer close(followDone); m.follow(campaign) }()
		err = el.Campaign(campaign, m.opts.ID)
		stop()
		<-followDone
		if err == nil {
			m.lead(ctx, session, el)
		} else if ctx.Err() == nil {
			m.log.Error(err, "Campaign for migration leader failed; retrying")
			sleep(ctx, time.Second)
		}
		// Revoke the session's lease with a context of its own (ctx may be cancelled
		// already): a successor is elected at once instead of after the TTL.
		rctx, cancel := context.WithTimeout(context.Background(), etcdTimeout)
		_, _ = m.opts.Client.Revoke(rctx, session.Lease())
		cancel()
		session.Close()
	}
}

// follow reads the leader's state from etcd for the status document until ctx ends.
func (m *Migrator) follow(ctx context.Context) {
	for {
		if st, err := m.readState(ctx); err == nil {
			m.mu.Lock()
			m.state = st
			m.mu.Unlock()
			m.refreshInventory(ctx, st.Records)
		}
		if !sleep(ctx, 2*time.Second) {
			return
		}
	}
}

func (m *Migrator) readState(ctx context.Context) (MigrationState, error) {
	var st MigrationState
	ctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	resp, err := m.opts.Client.Get(ctx, MigrationStateKey(m.opts.Prefix))
	if err != nil || len(resp.Kvs) == 0 {
		return st, err
	}
	err = json.Unmarshal(resp.Kvs[0].Value, &st)
	return st, err
}

type migrationResult struct {
	mig      Migration
	err      error
	revision int64
}

// lead runs while this apiserver holds the election.
func (m *Migrator) lead(ctx context.Context, session *concurrency.Session, el *concurrency.Election) {
	guard := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(el.Key()), "=", el.Rev())}
	names := make([]string, len(m.opts.Resources))
	for i, r := range m.opts.Resources {
		names[i] = r.String()
	}
	l := NewLeader(names, m.opts.Clock.Now())
	st, err := m.readState(ctx)
	if err != nil {
		m.log.Error(err, "Cannot read the migration state; starting without records")
	}
	l.Step(RecordsLoaded{Records: st.Records})
	l.Step(Leadership{Leading: true})
	m.log.Info("Elected storage migration leader", "apiserverID", m.opts.ID)
	m.mu.Lock()
	m.leading = true
	m.mu.Unlock()
	defer func() {
		m.mu.Lock()
		m.leading = false
		m.mu.Unlock()
	}()

	leadCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	results := make(chan migrationResult, 1)
	var progressMu sync.Mutex
	var progress *Progress
	running := false
	ticker := m.opts.Clock.NewTicker(time.Second)
	defer ticker.Stop()
	lastPublish := time.Time{}
	lastBody := ""
	for {
		now := m.opts.Clock.Now()
		l.Step(Tick{Now: now})
		l.Step(MembersChanged{Members: m.opts.Members()})
		for _, ev := range inventoryEvents(m.opts.Inventory.Latest()) {
			l.Step(ev)
		}
		if mig, ok := l.Next(); ok {
			running = true
			m.log.Info("Every live apiserver writes with the same key; migrating stored objects", "resource", mig.Resource, "target", mig.Target.String())
			go func() {
				rev, err := m.migrate(leadCtx, mig, guard, func(p Progress) {
					progressMu.Lock()
					progress = &p
					progressMu.Unlock()
				})
				results <- migrationResult{mig: mig, err: err, revision: rev}
			}()
		}
		progressMu.Lock()
		p := progress
		progressMu.Unlock()
		st := MigrationState{Leader: m.opts.ID, Records: l.Records(), Plans: l.Plans(), UpdatedAt: now}
		if mig, ok := l.Running(); ok {
			st.Running, st.Progress = &mig, p
		}
		m.mu.Lock()
		m.state = st
		m.mu.Unlock()
		m.refreshInventory(leadCtx, st.Records)
		// While a migration runs, progress is written every second; otherwise only what
		// changed, and every 30 s.
		body := st
		body.UpdatedAt = time.Time{}
		content, _ := json.Marshal(body)
		if (running && now.Sub(lastPublish) >= time.Second) || string(content) != lastBody || now.Sub(lastPublish) >= 30*time.Second {
			if data, err := json.Marshal(st); err == nil {
				err := guardedPut(m.opts.Client, MigrationStateKey(m.opts.Prefix), data, guard)
				if errors.Is(err, ErrNotLeader) {
					m.log.Info("Lost the migration leadership")
					cancel()
				}
				if err == nil {
					lastBody, lastPublish = string(content), now
				}
			}
		}

		select {
		case <-ctx.Done():
			if running {
				<-results
			}
			return
		case <-session.Done():
			m.log.Info("Migration leader session ended; stopping the running migration", "apiserverID", m.opts.ID)
			cancel()
			if running {
				<-results
			}
			return
		case <-leadCtx.Done():
			if running {
				<-results
			}
			return
		case r := <-results:
			running = false
			progressMu.Lock()
			progress = nil
			progressMu.Unlock()
			errText := ""
			if r.err != nil {
				errText = r.err.Error()
				m.log.Error(r.err, "Storage migration failed; the leader retries", "resource", r.mig.Resource)
			} else {
				m.log.Info("Storage migration verified", "resource", r.mig.Resource, "target", r.mig.Target.String())
			}
			l.Step(Tick{Now: m.opts.Clock.Now()})
			l.Step(MigrationFinished{Resource: r.mig.Resource, Target: r.mig.Target, Err: errText, Revision: r.revision})
		case <-m.opts.MembersChanged():
		case <-ticker.C():
		}
	}
}

// refreshInventory takes a fresh inventory of every resource whose local inventory was
// read before its latest verified migration (a follower's, or one the local controller
// took while the leader migrated), so that the guards and readiness stop counting objects
// under keys the migration left.
func (m *Migrator) refreshInventory(ctx context.Context, records map[string]Record) {
	if m.opts.Source == nil {
		return
	}
	latest := m.opts.Inventory.Latest()
	var stale []migrate.Resource
	for _, r := range m.opts.Resources {
		rec, ok := records[r.String()]
		if !ok || !rec.Verified || rec.Revision == 0 {
			continue
		}
		if ri := latest.Find(r.String()); ri == nil || ri.Revision < rec.Revision {
			stale = append(stale, r)
		}
	}
	if len(stale) == 0 {
		return
	}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: m.opts.Client, Source: m.opts.Source, Resources: stale,
		ConfigHash: m.opts.ConfigHash(), Metrics: m.opts.Metrics, Clock: m.opts.Clock})
	if err != nil {
		m.log.V(2).Info("Inventory after a cluster migration failed; retrying", "err", err)
		return
	}
	m.opts.Inventory.Set(mergeInventory(m.opts.Inventory.Latest(), inv))
}

// migrate runs one resource's migration with its checkpoint in etcd; it returns the
// etcd revision of the verifying re-scan.
func (m *Migrator) migrate(ctx context.Context, mig Migration, guard []clientv3.Cmp, report func(Progress)) (int64, error) {
	var resource migrate.Resource
	for _, r := range m.opts.Resources {
		if r.String() == mig.Resource {
			resource = r
		}
	}
	start := m.opts.Clock.Now()
	verified := &migrate.InventoryStore{}
	res, err := migrate.Migrate(ctx, migrate.Options{
		Client: m.opts.Client, Source: m.opts.Source, Resources: []migrate.Resource{resource}, Rate: m.opts.Rate,
		Checkpoints: &EtcdCheckpoints{Client: m.opts.Client, Key: CheckpointKey(m.opts.Prefix), Guard: guard},
		Resume:      true, Inventory: verified, Metrics: m.opts.Metrics, ConfigHash: m.opts.ConfigHash(), Logger: m.opts.Logger,
		Progress: func(p migrate.Progress) {
			pr := Progress{Resource: mig.Resource, Phase: p.Phase, Pass: p.Pass, Done: p.Done, Total: p.Total}
			if el := m.opts.Clock.Since(start).Seconds(); el > 0 {
				pr.Rate = float64(p.Scanned) / el
				if pr.Rate > 0 && p.Total > p.Done {
					pr.ETA = time.Duration(float64(p.Total-p.Done) / pr.Rate * float64(time.Second))
				}
			}
			report(pr)
		},
	})
	var rev int64
	if inv := verified.Latest(); inv != nil {
		m.opts.Inventory.Set(mergeInventory(m.opts.Inventory.Latest(), inv))
		if ri := inv.Find(mig.Resource); ri != nil {
			rev = ri.Revision
		}
	}
	rec := &migrate.MigrationRecord{Resources: []string{mig.Resource}, Finished: m.opts.Clock.Now()}
	if res != nil {
		rec.Duration, rec.Counters = res.Duration, res.Counters
	}
	if err != nil {
		rec.Error = err.Error()
	}
	m.mu.Lock()
	m.last = rec
	m.mu.Unlock()
	if err != nil {
		return rev, fmt.Errorf("migrating %s to %s: %w", mig.Resource, mig.Target, err)
	}
	return rev, nil
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
func inventoryEvents(inv *migrate.Inventory) []LeaderEvent {
	if inv == nil {
		return nil
	}
	var out []LeaderEvent
	for _, ri := range inv.Resources {
		ev := InventoryTaken{Resource: ri.Resource, TakenAt: inv.TakenAt}
		for _, c := range ri.Buckets {
			ev.Objects = append(ev.Objects, KeyCount{Key: Key{Provider: c.Provider, Key: c.Key, KeyIDHash: c.KeyIDHash}, Objects: c.Objects})
		}
		out = append(out, ev)
	}
	return out
}

// sleep waits d or until ctx ends; it reports whether ctx is still live.
func sleep(ctx context.Context, d time.Duration) bool {
	t := time.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
		return false
	case <-t.C:
		return true
	}
}
