package migrate

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// Controller defaults.
const (
	DefaultCheckInterval     = 5 * time.Second
	DefaultInventoryInterval = 10 * time.Minute
	// DefaultRetryBackoff and DefaultMaxRetryBackoff bound the wait before a failed
	// migration is tried again for the same write targets: it doubles from the first to
	// the second with every failure in a row.
	DefaultRetryBackoff    = 5 * time.Second
	DefaultMaxRetryBackoff = 5 * time.Minute
)

// ControllerOptions configure a Controller.
type ControllerOptions struct {
	Client    *clientv3.Client
	Source    Source
	Resources []Resource
	// AutoMigrate starts a migration when a resource's write key changes (and at start
	// when stale objects exist). When false the controller only takes inventories.
	AutoMigrate bool
	// CheckInterval is how often the write keys are compared; InventoryInterval how
	// often a fresh inventory is taken when nothing changes.
	CheckInterval     time.Duration
	InventoryInterval time.Duration
	// Rate limits rewrites (objects/s); 0 is unlimited.
	Rate float64
	// ConfigHash returns the active configuration's hash (recorded in inventories).
	ConfigHash func() string
	Inventory  *InventoryStore
	Metrics    *Metrics
	Logger     klog.Logger
	// Clock drives checks, retries and backoff; tests pass a fake clock.
	Clock clock.Clock
	// RetryBackoff and MaxRetryBackoff override the first and the longest wait before a
	// failed migration is retried (defaults: the smaller of DefaultRetryBackoff and
	// CheckInterval; DefaultMaxRetryBackoff).
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
	Error     string        `json:"error,omitempty"`
}

// Controller migrates stored data inside an apiserver: it watches the write target
// (prefix and KMS key id hash) of every resource and, when one changes, rewrites that
// resource's stale objects and records the verifying inventory, which the guard uses.
type Controller struct {
	opts ControllerOptions
	log  klog.Logger

	mu      sync.Mutex
	status  ControllerStatus
	applied map[string]writeTarget // targets the last successful migration or inventory saw
	// retry is the failed migration waiting for its backoff; nil when none. Only the
	// goroutine running Run touches it.
	retry *retryState
}

// retryState is a failed migration: which resources, under which write targets, how
// often in a row, and when it may run again.
type retryState struct {
	resources []Resource
	targets   string
	failures  int
	at        time.Time
}

// NewController returns a controller; call Run to start it.
func NewController(opts ControllerOptions) *Controller {
	if opts.CheckInterval <= 0 {
		opts.CheckInterval = DefaultCheckInterval
	}
	if opts.InventoryInterval <= 0 {
		opts.InventoryInterval = DefaultInventoryInterval
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
		opts.RetryBackoff = min(DefaultRetryBackoff, opts.CheckInterval)
	}
	if opts.MaxRetryBackoff < opts.RetryBackoff {
		opts.MaxRetryBackoff = max(DefaultMaxRetryBackoff, opts.RetryBackoff)
	}
	return &Controller{opts: opts, log: opts.Logger.WithName("storage-migration-controller"), status: ControllerStatus{AutoMigrate: opts.AutoMigrate}}
}

// Inventory is the store the controller's inventories land in; pass it to NewGuard.
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
// waits for its backoff (see DefaultRetryBackoff), not just for the next check.
func (c *Controller) Run(ctx context.Context) {
	var lastInventory time.Time
	for {
		if c.step(ctx, c.opts.Clock.Since(lastInventory) >= c.opts.InventoryInterval) {
			lastInventory = c.opts.Clock.Now()
		}
		t := c.opts.Clock.NewTimer(c.opts.CheckInterval)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		}
	}
}

// step runs one check; it returns true when it took an inventory.
func (c *Controller) step(ctx context.Context, inventoryDue bool) bool {
	now := c.currentTargets()
	changed, ready := c.plan(now)
	if r := c.retry; r != nil && c.opts.AutoMigrate && ready {
		// A failed migration is retried, with the resources changed since, once its
		// backoff has passed — at once when the write targets are no longer those it
		// failed with.
		todo := unionResources(r.resources, changed)
		if targetsKey(now, todo) == r.targets && c.opts.Clock.Now().Before(r.at) {
			return false
		}
		c.migrate(ctx, todo, now)
		return true
	}
	switch {
	case c.opts.AutoMigrate && len(changed) > 0 && ready:
		c.migrate(ctx, changed, now)
		return true
	case len(changed) > 0 || inventoryDue:
		inv, err := TakeInventory(ctx, InventoryOptions{Client: c.opts.Client, Source: c.opts.Source, Resources: c.opts.Resources, ConfigHash: c.opts.ConfigHash(), Metrics: c.opts.Metrics, Clock: c.opts.Clock})
		if err != nil {
			c.setErr(err)
			return false
		}
		c.opts.Inventory.Set(inv)
		c.mu.Lock()
		first := c.applied == nil
		c.applied = now
		c.mu.Unlock()
		// At start, stale data (e.g. from a migration cut short by a restart) is
		// migrated too.
		if first && c.opts.AutoMigrate && inv.TotalStale() > 0 && ready {
			var stale []Resource
			for _, r := range c.opts.Resources {
				if ri := inv.Find(r.String()); ri != nil && ri.Stale > 0 {
					stale = append(stale, r)
				}
			}
			c.migrate(ctx, stale, now)
		}
		return true
	}
	return false
}

func (c *Controller) currentTargets() map[string]writeTarget {
	t := map[string]writeTarget{}
	for _, r := range c.opts.Resources {
		t[r.String()] = targetOf(c.opts.Source.Rule(r.GroupResource))
	}
	return t
}

// plan lists the resources whose write target differs from the last applied one, and
// whether all of them can be written now (a KMS v2 target needs a known key id).
func (c *Controller) plan(now map[string]writeTarget) (changed []Resource, ready bool) {
	c.mu.Lock()
	applied := c.applied
	c.mu.Unlock()
	ready = true
	for _, r := range c.opts.Resources {
		t := now[r.String()]
		if strings.HasPrefix(t.Prefix, transformers.KMSv2Prefix) && t.KeyIDHash == "" {
			ready = false
		}
		if applied == nil {
			continue // first round: inventory decides
		}
		if applied[r.String()] != t {
			changed = append(changed, r)
		}
	}
	if applied == nil {
		return []Resource{}, ready
	}
	return changed, ready
}

func (c *Controller) migrate(ctx context.Context, rs []Resource, targets map[string]writeTarget) {
	if len(rs) == 0 {
		return
	}
	names := make([]string, len(rs))
	for i, r := range rs {
		names[i] = r.String()
	}
	c.mu.Lock()
	c.status.Running = names
	c.mu.Unlock()
	c.log.Info("Write key changed; migrating stored objects", "resources", names)
	// The verifying re-scan covers only rs; it is merged into the latest inventory so
	// that the guard keeps counting the other resources.
	verified := &InventoryStore{}
	res, err := Migrate(ctx, Options{Client: c.opts.Client, Source: c.opts.Source, Resources: rs, Rate: c.opts.Rate,
		Inventory: verified, Metrics: c.opts.Metrics, ConfigHash: c.opts.ConfigHash(), Logger: c.opts.Logger, Clock: c.opts.Clock})
	if inv := verified.Latest(); inv != nil {
		c.opts.Inventory.Set(mergeInventories(c.opts.Inventory.Latest(), inv, c.opts.Resources))
	}
	rec := &MigrationRecord{Resources: names, Finished: c.opts.Clock.Now()}
	if res != nil {
		rec.Duration, rec.Counters = res.Duration, res.Counters
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	c.status.Running = nil
	c.status.LastMigration = rec
	if err != nil {
		// applied stays, so the change is still pending; retry after a backoff that
		// grows while the same write targets keep failing.
		key := targetsKey(targets, rs)
		failures := 1
		if c.retry != nil && c.retry.targets == key {
			failures = c.retry.failures + 1
		}
		backoff := c.backoff(failures)
		at := c.opts.Clock.Now().Add(backoff)
		c.retry = &retryState{resources: rs, targets: key, failures: failures, at: at}
		c.status.ConsecutiveFailures, c.status.RetryAt = failures, at
		rec.Error = err.Error()
		if isTransient(err) {
			// Never advise deleting data because a plugin is down.
			msg := fmt.Sprintf("%v (next attempt at %s)", err, at.UTC().Format(time.RFC3339))
			if !strings.Contains(msg, ErrPluginUnavailable.Error()) {
				msg = ErrPluginUnavailable.Error() + ": " + msg
			}
			rec.Error, c.status.LastError = msg, msg
			c.log.Info("Storage migration stopped: KMS plugin unavailable, will retry", "resources", names, "retryIn", backoff, "failures", failures, "err", err)
			return
		}
		c.status.LastError = err.Error()
		c.log.Error(err, "Storage migration failed; will retry", "resources", names, "retryIn", backoff, "failures", failures)
		return
	}
	c.retry = nil
	c.status.ConsecutiveFailures, c.status.RetryAt = 0, time.Time{}
	c.status.LastError = ""
	if c.applied == nil {
		c.applied = map[string]writeTarget{}
	}
	for k, v := range targets {
		c.applied[k] = v
	}
}

// backoff is the wait after the given number of failures in a row: RetryBackoff,
// doubling up to MaxRetryBackoff.
func (c *Controller) backoff(failures int) time.Duration {
	d := c.opts.RetryBackoff
	for i := 1; i < failures && d < c.opts.MaxRetryBackoff; i++ {
		d *= 2
	}
	return min(d, c.opts.MaxRetryBackoff)
}

// targetsKey identifies the write targets of rs, so that a retry can tell whether
// they changed since a migration failed.
func targetsKey(targets map[string]writeTarget, rs []Resource) string {
	names := make([]string, 0, len(rs))
	for _, r := range rs {
		names = append(names, r.String())
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		t := targets[n]
		b.WriteString(n + "\x00" + t.Prefix + "\x00" + t.KeyIDHash + "\x00")
	}
	return b.String()
}

// unionResources is a followed by the resources of b not in a.
func unionResources(a, b []Resource) []Resource {
	out := append([]Resource(nil), a...)
	for _, r := range b {
		if !slices.Contains(out, r) {
			out = append(out, r)
		}
	}
	return out
}

func (c *Controller) setErr(err error) {
	c.mu.Lock()
	c.status.LastError = err.Error()
	c.mu.Unlock()
	c.log.Error(err, "Inventory failed; retrying at the next check")
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
