package migrate

import (
	"fmt"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// controllerMachine is the Controller's decisions, in etcd raft's shape: it never
// reads etcd, sleeps, logs or starts a goroutine. The driver (Controller.check) Steps
// it with what happened — a check of the write targets, an inventory taken, a migration
// finished — and carries out the actions Ready hands out, in order, Stepping the result
// of each inventory and migration back before asking Ready again. View is what the
// status document shows of it.
type controllerMachine struct {
	cfg machineConfig
	// applied are the targets the last successful migration or inventory saw; nil until
	// the first inventory.
	applied map[string]writeTarget
	// retry is the failed migration waiting for its backoff; nil when none.
	retry *retryState
	// lastWork is when an inventory or a migration last finished; the zero time makes
	// the first check take an inventory.
	lastWork time.Time
	// freshAsked: a fresh inventory was asked for and not taken yet.
	freshAsked bool
	// changeSeen holds the resources whose write-target change waits for an inventory
	// elsewhere (checkEvent.elsewhere), since when (for at most maxInventoryWait).
	changeSeen map[string]changeWait
	// inflight is the inventory or migration handed out and not yet Stepped back.
	inflight *controllerAction
	ready    []controllerAction
	view     controllerView
}

type machineConfig struct {
	resources         []Resource
	autoMigrate       bool
	inventoryInterval time.Duration
	// retryBackoff doubles with every failure in a row, up to maxRetryBackoff.
	retryBackoff, maxRetryBackoff time.Duration
}

// retryState is a failed migration: which resources, under which write targets, how
// often in a row, and when it may run again.
type retryState struct {
	resources []Resource
	targets   string
	failures  int
	at        time.Time
}

// controllerView is the machine's part of ControllerStatus.
type controllerView struct {
	LastError           string
	ConsecutiveFailures int
	RetryAt             time.Time
	// MigrationError is what the last finished migration's record says went wrong.
	MigrationError string
}

// controllerEvent is one input of the machine: checkEvent, inventoryEvent or
// migrationEvent.
type controllerEvent interface{ controllerEvent() }

// checkEvent: at now, the resources are written with targets.
type checkEvent struct {
	now     time.Time
	targets map[string]writeTarget
	// resources, when not nil, replaces the resources the controller covers: a wildcard
	// rule's resources are found again at every check.
	resources []Resource
	// freshAsked: the guard refused a change on the latest inventory's word since the
	// last check (InventoryStore.AskFresh).
	freshAsked bool
	// elsewhere: the resources whose inventory under their current write target
	// another component takes now (the elected cluster migrator, whose verifying
	// re-scan becomes this apiserver's inventory); a write-target change of them does
	// not scan here while they are listed. Only without autoMigrate.
	elsewhere map[string]bool
	// stored is the latest stored inventory of each resource (InventoryStore.Latest).
	stored map[string]storedInventory
}

// changeWait is a write-target change waiting for an inventory elsewhere: since when,
// and the revision of the stored inventory of its resource then (0: none). A later one
// taken under the new target settles the change without a scan here.
type changeWait struct {
	since    time.Time
	revision int64
}

// maxInventoryWait is the longest a write-target change waits for an inventory
// elsewhere before this controller takes its own: a migration of a million objects
// runs for many minutes, and the stale counts (the status, rekey_storage_objects and
// the alerts on it) must not be the ones of before the change all that time.
const maxInventoryWait = time.Minute

// storedInventory is what the machine needs of a stored inventory of one resource:
// the etcd revision it read at and the write target it counted against.
type storedInventory struct {
	revision int64
	target   writeTarget
}

// inventoryEvent: the inventory the machine asked for was taken (or failed) at now.
type inventoryEvent struct {
	now time.Time
	inv *Inventory
	err error
}

// migrationEvent: the migration the machine asked for ended at now; verified is its
// re-scan of the migrated resources, nil when it did not get that far.
type migrationEvent struct {
	now      time.Time
	verified *Inventory
	err      error
}

func (checkEvent) controllerEvent()     {}
func (inventoryEvent) controllerEvent() {}
func (migrationEvent) controllerEvent() {}

type actionKind int

const (
	// actTakeInventory: scan every resource; Step an inventoryEvent.
	actTakeInventory actionKind = iota
	// actMigrate: migrate resources to targets; Step a migrationEvent.
	actMigrate
	// actRecordInventory: make inventory the latest one (merged into the latest over the
	// resources it does not cover, when merge is set).
	actRecordInventory
)

// controllerAction is one thing the driver must do. The caller owns it.
type controllerAction struct {
	kind      actionKind
	resources []Resource             // actMigrate
	targets   map[string]writeTarget // actTakeInventory, actMigrate: the check's targets
	ready     bool                   // actTakeInventory: every target can be written now
	inventory *Inventory             // actRecordInventory
	merge     bool                   // actRecordInventory
}

func newControllerMachine(cfg machineConfig) *controllerMachine {
	return &controllerMachine{cfg: cfg}
}

// Ready returns the actions to carry out, in order, and forgets them.
func (m *controllerMachine) Ready() []controllerAction {
	acts := m.ready
	m.ready = nil
	return acts
}

// View is the machine's status.
func (m *controllerMachine) View() controllerView { return m.view }

// Step feeds one event.
func (m *controllerMachine) Step(ev controllerEvent) {
	switch ev := ev.(type) {
	case checkEvent:
		m.freshAsked = m.freshAsked || ev.freshAsked
		if m.inflight == nil {
			m.check(ev)
		}
	case inventoryEvent:
		if a := m.inflight; a != nil && a.kind == actTakeInventory {
			m.inflight = nil
			m.inventoryTaken(ev, a)
		}
	case migrationEvent:
		if a := m.inflight; a != nil && a.kind == actMigrate {
			m.inflight = nil
			m.migrated(ev, a)
		}
	}
}

func (m *controllerMachine) hand(a controllerAction) {
	if a.kind != actRecordInventory {
		m.inflight = &a
	}
	m.ready = append(m.ready, a)
}

func (m *controllerMachine) check(ev checkEvent) {
	if ev.resources != nil {
		m.cfg.resources = ev.resources
	}
	changed, ready := m.plan(ev.targets)
	if !m.cfg.autoMigrate {
		changed = m.leaveElsewhere(ev, changed)
	}
	if r := m.retry; r != nil && m.cfg.autoMigrate && ready {
		// A failed migration is retried, with the resources changed since, once its
		// backoff has passed — at once when the write targets are no longer those it
		// failed with.
		todo := unionResources(r.resources, changed)
		if targetsKey(ev.targets, todo) == r.targets && ev.now.Before(r.at) {
			return
		}
		m.hand(controllerAction{kind: actMigrate, resources: todo, targets: ev.targets})
		return
	}
	switch {
	case m.cfg.autoMigrate && len(changed) > 0 && ready:
		m.hand(controllerAction{kind: actMigrate, resources: changed, targets: ev.targets})
	case len(changed) > 0 || ev.now.Sub(m.lastWork) >= m.cfg.inventoryInterval ||
		m.freshAsked && ev.now.Sub(m.lastWork) >= min(minAskedInventoryInterval, m.cfg.inventoryInterval):
		m.hand(controllerAction{kind: actTakeInventory, targets: ev.targets, ready: ready})
	}
}

// leaveElsewhere returns the changed resources this controller must scan: a change
// settled by a stored inventory taken since it was first seen, under the new target
// (the cluster migrator's adopted re-scan), is applied without one, and a change of a
// resource another component is inventorying waits for it. Three apiservers each
// scanning 10,000 Secrets the moment the leader began migrating them cost the clients
// a second at three times their p99, and the migration a halving of its rate, for
// counts the migration made stale within seconds.
func (m *controllerMachine) leaveElsewhere(ev checkEvent, changed []Resource) []Resource {
	var scan []Resource
	seen := map[string]changeWait{}
	for _, r := range changed {
		name := r.String()
		t := ev.targets[name]
		w, waited := m.changeSeen[name]
		if !waited {
			w = changeWait{since: ev.now, revision: ev.stored[name].revision}
		}
		if st, ok := ev.stored[name]; waited && ok && st.revision > w.revision && st.target == t {
			m.applied[name] = t
			continue
		}
		if ev.elsewhere[name] && ev.now.Sub(w.since) < maxInventoryWait {
			seen[name] = w
			continue
		}
		scan = append(scan, r)
	}
	m.changeSeen = seen
	return scan
}

// plan lists the resources whose write target differs from the last applied one (or
// whose change waits for an inventory elsewhere: a change back to the applied target
// in the meantime is still one, as the objects written in between are not in the
// inventory of then), and
// whether all of them can be written now (a KMS v2 target needs a known key id).
func (m *controllerMachine) plan(targets map[string]writeTarget) (changed []Resource, ready bool) {
	ready = true
	for _, r := range m.cfg.resources {
		t := targets[r.String()]
		if strings.HasPrefix(t.Prefix, transformers.KMSv2Prefix) && t.KeyIDHash == "" {
			ready = false
		}
		_, waiting := m.changeSeen[r.String()]
		if m.applied != nil && (m.applied[r.String()] != t || waiting) {
			changed = append(changed, r)
		}
	}
	return changed, ready
}

func (m *controllerMachine) inventoryTaken(ev inventoryEvent, a *controllerAction) {
	if ev.err != nil {
		m.view.LastError = ev.err.Error()
		return
	}
	m.lastWork, m.freshAsked, m.changeSeen = ev.now, false, nil
	m.ready = append(m.ready, controllerAction{kind: actRecordInventory, inventory: ev.inv})
	first := m.applied == nil
	m.applied = a.targets
	// At start, stale data (e.g. from a migration cut short by a restart) is migrated
	// too.
	if first && m.cfg.autoMigrate && ev.inv.TotalStale() > 0 && a.ready {
		var stale []Resource
		for _, r := range m.cfg.resources {
			if ri := ev.inv.Find(r.String()); ri != nil && ri.Stale > 0 {
				stale = append(stale, r)
			}
		}
		if len(stale) > 0 {
			m.hand(controllerAction{kind: actMigrate, resources: stale, targets: a.targets})
		}
	}
}

func (m *controllerMachine) migrated(ev migrationEvent, a *controllerAction) {
	m.lastWork = ev.now
	if ev.verified != nil {
		// The verifying re-scan covers only the migrated resources; it is merged into
		// the latest inventory so that the guard keeps counting the others.
		m.ready = append(m.ready, controllerAction{kind: actRecordInventory, inventory: ev.verified, merge: true})
	}
	if ev.err == nil {
		m.retry = nil
		m.view = controllerView{}
		if m.applied == nil {
			m.applied = map[string]writeTarget{}
		}
		for k, v := range a.targets {
			m.applied[k] = v
		}
		return
	}
	// applied stays, so the change is still pending; retry after a backoff that grows
	// while the same write targets keep failing.
	key := targetsKey(a.targets, a.resources)
	failures := 1
	if m.retry != nil && m.retry.targets == key {
		failures = m.retry.failures + 1
	}
	at := ev.now.Add(m.backoff(failures))
	m.retry = &retryState{resources: a.resources, targets: key, failures: failures, at: at}
	msg := ev.err.Error()
	if isTransient(ev.err) {
		// Never advise deleting data because a plugin is down.
		msg = fmt.Sprintf("%v (next attempt at %s)", ev.err, at.UTC().Format(time.RFC3339))
		if !strings.Contains(msg, errPluginUnavailable.Error()) {
			msg = errPluginUnavailable.Error() + ": " + msg
		}
	}
	m.view = controllerView{LastError: msg, ConsecutiveFailures: failures, RetryAt: at, MigrationError: msg}
}

// backoff is the wait after the given number of failures in a row: retryBackoff,
// doubling up to maxRetryBackoff.
func (m *controllerMachine) backoff(failures int) time.Duration {
	d := m.cfg.retryBackoff
	for i := 1; i < failures && d < m.cfg.maxRetryBackoff; i++ {
		d *= 2
	}
	return min(d, m.cfg.maxRetryBackoff)
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
