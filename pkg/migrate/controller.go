package migrate

import (
	"context"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// Controller defaults.
const (
	defaultCheckInterval     = 5 * time.Second
	defaultInventoryInterval = 10 * time.Minute
	// minAskedInventoryInterval: a fresh inventory the guard asks for
	// (InventoryStore.AskFresh) is taken once this long has passed since the last
	// inventory or migration, so that a change refused again every few seconds does
	// not keep the controller scanning.
	minAskedInventoryInterval = 30 * time.Second
	// defaultRetryBackoff and defaultMaxRetryBackoff bound the wait before a failed
	// migration is tried again for the same write targets: it doubles from the first to
	// the second with every failure in a row.
	defaultRetryBackoff    = 5 * time.Second
	defaultMaxRetryBackoff = 5 * time.Minute
)

// ControllerOptions configure a Controller.
type ControllerOptions struct {
	Client    *clientv3.Client
	Source    Source
	Resources []Resource
	// Resolve, when set, replaces Resources: it is asked at every check which
	// resources the rules cover now (Resolver.Resolve on the current rules), so a
	// wildcard rule's resources stored since are seen. A failed resolution keeps the
	// last list.
	Resolve func(ctx context.Context) (Resolution, error)
	// AutoMigrate starts a migration when a resource's write key changes (and at start
	// when stale objects exist). When false the controller only takes inventories.
	AutoMigrate bool
	// CheckInterval is how often the write keys are compared (default 5 s);
	// InventoryInterval how often a fresh inventory is taken when nothing changes
	// (default 10 minutes).
	CheckInterval     time.Duration
	InventoryInterval time.Duration
	// Rate is the ceiling of the adaptive rewrite rate (objects/s); 0 is no ceiling.
	Rate float64
	// Space bounds how full migrations let etcd's database get (see pace.SpaceOptions).
	Space pace.SpaceOptions
	// Pacing tunes the adaptive rate (its Ceiling is Rate): in an apiserver, its
	// Serving is the apiserver's own request latency.
	Pacing pace.Options
	// ConfigHash returns the active configuration's hash (recorded in inventories).
	ConfigHash func() string
	// CoordinationPrefix, when set, is where acknowledged unreadable objects are read
	// from (see Acknowledge).
	CoordinationPrefix string
	Inventory          *InventoryStore
	Metrics            *Metrics
	Logger             klog.Logger
	// Clock drives checks, retries and backoff; tests pass a fake clock.
	Clock clock.Clock
	// MigrationClock is what the migrations the controller starts measure and wait
	// with: etcd's latencies, their pacing windows, their pauses between attempts on an
	// etcd that does not answer. The real clock when nil, whatever Clock is: a
	// migration run on a test's fake Clock waited for a step that never came once an
	// etcd transaction had timed out (a starved test process) and its retry slept on
	// that clock; the test hung to its timeout.
	MigrationClock clock.Clock
	// InventoriedElsewhere, when set, reports whether another component takes the
	// inventory of resource under its write target (prefix, and for KMS v2 the key id
	// hash) now: with coordination, whether the elected cluster migrator is rewriting
	// it to that target (its verifying re-scan becomes this apiserver's inventory).
	// While it does, a write-target change of the resource takes no inventory here;
	// an inventory stored since the change under the new target settles it. Ignored
	// with AutoMigrate.
	InventoriedElsewhere func(resource, prefix, keyIDHash string) bool
	// RetryBackoff and MaxRetryBackoff override the first and the longest wait before a
	// failed migration is retried (defaults: the smaller of 5 s and CheckInterval;
	// 5 minutes).
	RetryBackoff, MaxRetryBackoff time.Duration
}

// ControllerStatus is the controller's part of the agent's status document.
type ControllerStatus struct {
	AutoMigrate bool `json:"autoMigrate"`
	// Running is the resources being migrated now.
	Running []string `json:"running,omitempty"`
	// LastMigration is the latest finished migration.
	LastMigration *MigrationRecord `json:"lastMigration,omitempty"`
	// Inventory is the latest inventory.
	Inventory *Inventory `json:"inventory,omitempty"`
	LastError string     `json:"lastError,omitempty"`
	// ConsecutiveFailures counts failed migrations in a row for the same write targets.
	ConsecutiveFailures int `json:"consecutiveFailures,omitempty"`
	// RetryAt is when a failed migration is tried next (unless the write targets change
	// first).
	RetryAt time.Time `json:"retryAt,omitzero"`
}

// MigrationRecord summarises one finished migration.
type MigrationRecord struct {
	Resources []string      `json:"resources"`
	Finished  time.Time     `json:"finished"`
	Duration  time.Duration `json:"duration"`
	Counters  Counters      `json:"counters"`
	// Acknowledged is how many unreadable objects the verifying re-scan found
	// acknowledged: the migration is verified except them.
	Acknowledged int64  `json:"acknowledged,omitempty"`
	Error        string `json:"error,omitempty"`
}

// Controller migrates stored data inside an apiserver: it watches the write target
// (prefix and KMS key id hash) of every resource and, when one changes, rewrites that
// resource's stale objects and records the verifying inventory, which the guard uses.
//
// Its decisions are a state machine (controllerMachine); the Controller is the thin
// driver that reads the write targets, runs inventories and migrations against etcd,
// and publishes the status.
type Controller struct {
	opts ControllerOptions
	log  klog.Logger
	// m is only touched by the goroutine running Run.
	m *controllerMachine

	mu     sync.Mutex
	status ControllerStatus
	// resolved is Resolve's last good answer.
	resolved Resolution
}

// NewController returns a controller; call Run to start it.
func NewController(opts ControllerOptions) *Controller {
	if opts.CheckInterval <= 0 {
		opts.CheckInterval = defaultCheckInterval
	}
	if opts.InventoryInterval <= 0 {
		opts.InventoryInterval = defaultInventoryInterval
	}
	if opts.MigrationClock == nil {
		opts.MigrationClock = clock.RealClock{}
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	if opts.Inventory == nil {
		opts.Inventory = &InventoryStore{}
	}
	if opts.ConfigHash == nil {
		opts.ConfigHash = func() string { return "" }
	}
	if opts.RetryBackoff <= 0 {
		// The first retry comes one check later, as before backoff existed.
		opts.RetryBackoff = min(defaultRetryBackoff, opts.CheckInterval)
	}
	if opts.MaxRetryBackoff < opts.RetryBackoff {
		opts.MaxRetryBackoff = max(defaultMaxRetryBackoff, opts.RetryBackoff)
	}
	m := newControllerMachine(machineConfig{resources: opts.Resources, autoMigrate: opts.AutoMigrate,
		inventoryInterval: opts.InventoryInterval, retryBackoff: opts.RetryBackoff, maxRetryBackoff: opts.MaxRetryBackoff})
	return &Controller{opts: opts, log: opts.Logger.WithName("storage-migration-controller"), m: m, status: ControllerStatus{AutoMigrate: opts.AutoMigrate}}
}

// Inventory is the store the controller's inventories land in; pass it to guard.New.
func (c *Controller) Inventory() *InventoryStore { return c.opts.Inventory }

// Status returns a snapshot for the status document.
func (c *Controller) Status() ControllerStatus {
	c.mu.Lock()
	defer c.mu.Unlock()
	st := c.status
	st.Running = append([]string(nil), st.Running...)
	st.Inventory = c.opts.Inventory.Latest()
	return st
}

// Run checks CheckInterval after each check ends, until ctx ends. A failed migration
// waits for its backoff (see defaultRetryBackoff), not just for the next check.
func (c *Controller) Run(ctx context.Context) {
	for {
		c.check(ctx)
		t := c.opts.Clock.NewTimer(c.opts.CheckInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
	}
}

// check feeds the machine the current write targets and carries out what it asks for.
// It returns true when it took an inventory or ran a migration.
func (c *Controller) check(ctx context.Context) bool {
	res := c.resolve(ctx)
	targets := c.currentTargets(res.Resources)
	c.m.Step(checkEvent{now: c.opts.Clock.Now(), targets: targets, resources: res.Resources,
		freshAsked: c.opts.Inventory.takeAsk(), elsewhere: c.inventoriedElsewhere(targets), stored: storedInventories(c.opts.Inventory.Latest())})
	worked := false
	for acts := c.m.Ready(); len(acts) > 0; acts = c.m.Ready() {
		for _, a := range acts {
			switch a.kind {
			case actTakeInventory:
				inv, err := TakeInventory(ctx, InventoryOptions{Client: c.opts.Client, Source: c.opts.Source, Resources: res.Resources, Wildcards: res.Wildcards, ConfigHash: c.opts.ConfigHash(),
					CoordinationPrefix: c.opts.CoordinationPrefix, Metrics: c.opts.Metrics, Clock: c.opts.Clock})
				c.m.Step(inventoryEvent{now: c.opts.Clock.Now(), inv: inv, err: err})
				c.publish(nil)
				if err != nil {
					c.log.Error(err, "Inventory failed; retrying at the next check")
				} else {
					c.log.V(2).Info("Took an inventory", "resources", len(inv.Resources), "stale", inv.TotalStale(), "duration", inv.Duration)
				}
				worked = worked || err == nil
			case actRecordInventory:
				inv := a.inventory
				if a.merge {
					inv = mergeInventories(c.opts.Inventory.Latest(), inv, res.Resources)
				}
				c.opts.Inventory.Set(inv)
			case actMigrate:
				c.migrate(ctx, a.resources)
				worked = true
			}
		}
	}
	return worked
}

// inventoriedElsewhere lists the resources of targets whose inventory another
// component takes now (ControllerOptions.InventoriedElsewhere).
func (c *Controller) inventoriedElsewhere(targets map[string]writeTarget) map[string]bool {
	if c.opts.InventoriedElsewhere == nil || c.opts.AutoMigrate {
		return nil
	}
	out := map[string]bool{}
	for r, t := range targets {
		if c.opts.InventoriedElsewhere(r, t.Prefix, t.KeyIDHash) {
			out[r] = true
		}
	}
	return out
}

// storedInventories is what the controller's machine needs of inv, per resource.
func storedInventories(inv *Inventory) map[string]storedInventory {
	if inv == nil {
		return nil
	}
	out := make(map[string]storedInventory, len(inv.Resources))
	for _, ri := range inv.Resources {
		out[ri.Resource] = storedInventory{revision: ri.Revision, target: writeTarget{Prefix: ri.WritePrefix, KeyIDHash: ri.WriteKeyIDHash}}
	}
	return out
}

// resolve returns the resources to cover now: Resources, or Resolve's answer (the
// last good one when it fails).
func (c *Controller) resolve(ctx context.Context) Resolution {
	if c.opts.Resolve == nil {
		return Resolution{Resources: c.opts.Resources}
	}
	res, err := c.opts.Resolve(ctx)
	c.mu.Lock()
	defer c.mu.Unlock()
	if err != nil {
		c.log.Error(err, "Cannot list the stored resources the rules cover; keeping the last list")
		return c.resolved
	}
	c.resolved = res
	return res
}

// Resources are the resources the controller covers now: Resources, or Resolve's last
// good answer.
func (c *Controller) Resources() []Resource {
	if c.opts.Resolve == nil {
		return c.opts.Resources
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.resolved.Resources
}

func (c *Controller) currentTargets(resources []Resource) map[string]writeTarget {
	t := map[string]writeTarget{}
	for _, r := range resources {
		t[r.String()] = targetOf(c.opts.Source.Rule(r.GroupResource))
	}
	return t
}

func (c *Controller) migrate(ctx context.Context, rs []Resource) {
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.String()
	}
	c.mu.Lock()
	c.status.Running = names
	c.mu.Unlock()
	c.log.Info("Write key changed; migrating stored objects", "resources", names)
	verified := &InventoryStore{}
	res, err := Migrate(ctx, Options{Client: c.opts.Client, Source: c.opts.Source, Resources: rs, Rate: c.opts.Rate, Space: c.opts.Space,
		Pacing:    c.opts.Pacing,
		Inventory: verified, Metrics: c.opts.Metrics, ConfigHash: c.opts.ConfigHash(), CoordinationPrefix: c.opts.CoordinationPrefix,
		Logger: c.opts.Logger, Clock: c.opts.MigrationClock})
	now := c.opts.Clock.Now()
	c.m.Step(migrationEvent{now: now, verified: verified.Latest(), err: err})
	rec := &MigrationRecord{Resources: names, Finished: now}
	if res != nil {
		rec.Duration, rec.Counters, rec.Acknowledged = res.Duration, res.Counters, res.Acknowledged
	}
	view := c.publish(rec)
	switch {
	case err == nil:
	case isTransient(err):
		c.log.Info("Storage migration stopped: KMS plugin unavailable, will retry", "resources", names, "retryIn", view.RetryAt.Sub(now), "failures", view.ConsecutiveFailures, "err", err)
	default:
		c.log.Error(err, "Storage migration failed; will retry", "resources", names, "retryIn", view.RetryAt.Sub(now), "failures", view.ConsecutiveFailures)
	}
}

// publish copies the machine's view into the status, with rec as the latest finished
// migration when it is not nil.
func (c *Controller) publish(rec *MigrationRecord) controllerView {
	v := c.m.View()
	c.mu.Lock()
	defer c.mu.Unlock()
	if rec != nil {
		rec.Error = v.MigrationError
		c.status.Running = nil
		c.status.LastMigration = rec
	}
	c.status.LastError, c.status.ConsecutiveFailures, c.status.RetryAt = v.LastError, v.ConsecutiveFailures, v.RetryAt
	return v
}

// mergeInventories returns newer with the resources it does not cover taken from older,
// in the order of resources. TakenAt and ConfigHash are newer's; every resource keeps
// its own revision and write key, which is what the guard compares.
func mergeInventories(older, newer *Inventory, resources []Resource) *Inventory {
	if older == nil {
		return newer
	}
	out := *newer
	out.Resources = nil
	if len(out.Wildcards) == 0 {
		// A partial re-scan: older still covers the wildcard rules' other resources.
		out.Wildcards = older.Wildcards
	}
	for _, r := range resources {
		if ri := newer.Find(r.String()); ri != nil {
			out.Resources = append(out.Resources, *ri)
		} else if ri := older.Find(r.String()); ri != nil {
			out.Resources = append(out.Resources, *ri)
			out.DecryptChecked = out.DecryptChecked && older.DecryptChecked
		}
	}
	return &out
}
