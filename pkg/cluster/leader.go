package cluster

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"
)

// leader decides what the elected migration leader migrates, a pure state machine in
// etcd raft's shape (no I/O, no goroutines, time through Step). The driver (Migrator)
// feeds it leadership, the live members, inventories and migration results; like
// raft's Ready and Advance, Ready says which migration to start (and changes nothing),
// the driver starts it and acknowledges with migrationStarted, and reports its end
// with migrationFinished.
//
// Rules:
//   - only one migration runs at a time, and only while leading;
//   - resource R is migrated only when every live member writes R with the same key (for
//     KMS: the same provider and the same key id hash — every plugin has seen the new key
//     id), the target T;
//   - the record of a finished migration keeps the target captured when it started, so
//     when the write key changed meanwhile, the record differs from the new common key
//     and that key is migrated next — never skipped;
//   - R is migrated again when an inventory newer than its record counts objects not
//     under T (a straggler wrote with an old key); "newer" compares etcd revisions,
//     never the members' clocks, which may disagree;
//   - a failed migration is retried with exponential backoff (2 s doubling to 1 min);
//   - a resource never migrated whose inventory finds every object on the common
//     write key is recorded as verified by that inventory (adoptInventories).
type leader struct {
	resources []string
	now       time.Time
	leading   bool
	members   []MemberState // sorted by id (memberList)
	records   map[string]Record
	inventory map[string]inventoryTaken
	running   *Migration
	failures  map[string]int
	retryAt   map[string]time.Time
}

// Record is the outcome of the latest migration of a resource, kept in etcd.
type Record struct {
	// Target is the write key captured when the migration started.
	Target Key `json:"target"`
	// Verified is set when the verifying re-scan found no object off Target.
	Verified   bool      `json:"verified"`
	StartedAt  time.Time `json:"startedAt"`
	FinishedAt time.Time `json:"finishedAt"`
	Error      string    `json:"error,omitempty"`
	// Revision is the etcd revision of the verifying re-scan (for a migration that
	// failed before it, the revision when it failed): an inventory read at an older
	// revision predates the migration (each apiserver then takes a fresh one). A record
	// of an older rekey has none and counts as older than any inventory.
	Revision int64 `json:"revision,omitempty"`
	// Acknowledged is how many unreadable objects the verifying re-scan found
	// acknowledged: the migration is verified except them.
	Acknowledged int64 `json:"acknowledged,omitempty"`
	// SustainedRate is the highest rate (objects/s) the migration achieved while the
	// leader's clients were answered within target: where the next migration starts
	// from (pace.Options.KnownRate).
	SustainedRate float64 `json:"sustainedRatePerSecond,omitempty"`
	// PacedBy are the apiservers whose clients paced the migration (see
	// Progress.PacedBy).
	PacedBy []string `json:"pacedByClientsOf,omitempty"`
}

// Migration is one migration to start or running.
type Migration struct {
	Resource  string    `json:"resource"`
	Target    Key       `json:"target"`
	StartedAt time.Time `json:"startedAt"`
}

// leaderEvent is an input of leader.Step.
type leaderEvent interface{ leaderEvent() }

// leadership reports winning or losing the election.
type leadership struct{ Leading bool }

// recordsLoaded carries the records read from etcd when leadership is won.
type recordsLoaded struct{ Records map[string]Record }

// resourcesChanged replaces the resources the leader migrates (a wildcard rule's
// resources are found in etcd as objects are stored); an empty list keeps the last.
type resourcesChanged struct{ Resources []string }

// inventoryTaken reports what is stored for a resource, by key.
type inventoryTaken struct {
	Resource string
	// Revision is the etcd revision the inventory read at: what orders it against
	// records and other inventories. TakenAt is for people.
	Revision int64
	TakenAt  time.Time
	Objects  []keyCount
}

// keyCount is how many stored objects one key encrypts.
type keyCount struct {
	Key     Key
	Objects int64
}

// migrationStarted acknowledges that the driver started the migration Ready returned:
// from now on it runs, and nothing else starts until it finishes.
type migrationStarted struct{ Migration Migration }

// migrationFinished reports the end of the migration that started; Err is empty when
// the verifying re-scan found every object on the target.
type migrationFinished struct {
	Resource string
	Target   Key
	Err      string
	// Revision is the verifying re-scan's etcd revision, else the revision when the
	// migration ended (0 when unknown).
	Revision int64
	// Acknowledged is how many acknowledged unreadable objects the re-scan found.
	Acknowledged int64
	// SustainedRate, PacedBy: see Record.
	SustainedRate float64
	PacedBy       []string
}

func (leadership) leaderEvent()        {}
func (migrationStarted) leaderEvent()  {}
func (recordsLoaded) leaderEvent()     {}
func (inventoryTaken) leaderEvent()    {}
func (migrationFinished) leaderEvent() {}
func (membersChanged) leaderEvent()    {}
func (resourcesChanged) leaderEvent()  {}
func (tick) leaderEvent()              {}

const (
	retryBase = 2 * time.Second
	retryMax  = time.Minute
)

// newLeader returns the decision machine for resources (as a member rule or an
// inventory names them: "secrets", "configmaps").
func newLeader(resources []string, now time.Time) *leader {
	return &leader{resources: slices.Clone(resources), now: now,
		records: map[string]Record{}, inventory: map[string]inventoryTaken{},
		failures: map[string]int{}, retryAt: map[string]time.Time{}}
}

// Step feeds one event.
func (l *leader) Step(ev leaderEvent) {
	switch e := ev.(type) {
	case leadership:
		l.leading = e.Leading
	case recordsLoaded:
		for r, rec := range e.Records {
			if cur, ok := l.records[r]; !ok || rec.Revision > cur.Revision {
				l.records[r] = rec
			}
		}
	case inventoryTaken:
		if cur, ok := l.inventory[e.Resource]; !ok || e.Revision >= cur.Revision {
			l.inventory[e.Resource] = e
		}
		l.adoptInventories()
	case resourcesChanged:
		if len(e.Resources) > 0 {
			l.resources = slices.Clone(e.Resources)
		}
		l.adoptInventories()
	case membersChanged:
		l.members = memberList(e.Members, "")
		l.adoptInventories()
	case migrationStarted:
		// The driver reports what it did: the migration runs, even if the leader
		// would no longer choose it. Only a second one at once is refused (a driver
		// that starts two would break the one-at-a-time rule anyway).
		if l.running == nil {
			m := e.Migration
			l.running = &m
		}
	case migrationFinished:
		if l.running == nil || l.running.Resource != e.Resource {
			return
		}
		rec := Record{Target: l.running.Target, StartedAt: l.running.StartedAt, FinishedAt: l.now, Error: e.Err, Verified: e.Err == "",
			Revision: e.Revision, Acknowledged: e.Acknowledged, SustainedRate: e.SustainedRate, PacedBy: e.PacedBy}
		if rec.SustainedRate == 0 {
			// A migration whose clients were never judged (all of it during an etcd
			// outage, or too short) learned nothing new: the rate known before stays.
			rec.SustainedRate = l.records[e.Resource].SustainedRate
		}
		l.running = nil
		if e.Err != "" {
			l.failures[e.Resource]++
			backoff := retryBase << min(l.failures[e.Resource]-1, 10)
			l.retryAt[e.Resource] = l.now.Add(min(backoff, retryMax))
		} else {
			delete(l.failures, e.Resource)
			delete(l.retryAt, e.Resource)
		}
		l.records[e.Resource] = rec
	case tick:
		if e.Now.After(l.now) {
			l.now = e.Now
		}
	}
}

// adoptInventories records, for a resource never migrated, an inventory that found
// every stored object under the common write key as a verified migration to it: the
// inventory read every object at its revision, as a verifying re-scan does, so no
// migration is due, and without a record the rotation that waits for one (rekey rotate
// --wait's stage 2) would wait for ever. It happens on a cluster's first rotation when
// the clients rewrote every object before an inventory was taken.
func (l *leader) adoptInventories() {
	for _, r := range l.resources {
		if _, hasRec := l.records[r]; hasRec || (l.running != nil && l.running.Resource == r) {
			continue
		}
		inv, ok := l.inventory[r]
		if !ok || inv.Revision <= 0 {
			continue
		}
		target, ok, _ := commonWriteKey(l.members, r)
		if !ok || offTarget(inv, target) > 0 {
			continue
		}
		l.records[r] = Record{Target: target, Verified: true, StartedAt: inv.TakenAt, FinishedAt: inv.TakenAt, Revision: inv.Revision}
	}
}

// Ready returns the migration to start now, if any: only while leading and nothing
// runs, the first resource (in the order newLeader was given) whose plan is
// PlanMigrate. It changes nothing; asking again gives the same answer until an event
// changes the inputs. The driver that starts it steps migrationStarted.
func (l *leader) Ready() (Migration, bool) {
	if !l.leading || l.running != nil {
		return Migration{}, false
	}
	for _, r := range l.resources {
		if p := l.plan(r); p.State == PlanMigrate {
			return Migration{Resource: r, Target: p.Target, StartedAt: l.now}, true
		}
	}
	return Migration{}, false
}

// Running is the migration in progress, if any.
func (l *leader) Running() (Migration, bool) {
	if l.running == nil {
		return Migration{}, false
	}
	return *l.running, true
}

// Records returns the records by resource.
func (l *leader) Records() map[string]Record {
	out := make(map[string]Record, len(l.records))
	for k, v := range l.records {
		out[k] = v
	}
	return out
}

// Plan states.
const (
	PlanDone      = "done"      // every object is on the common write key
	PlanMigrate   = "migrate"   // due now
	PlanRunning   = "running"   // migrating now
	PlanWaiting   = "waiting"   // members disagree, or none is live
	PlanRetrying  = "retrying"  // the last attempt failed; backing off
	PlanFollowing = "following" // another apiserver leads
)

// Plan describes what the leader would do for one resource and why.
type Plan struct {
	Resource string `json:"resource"`
	State    string `json:"state"`
	Target   Key    `json:"target,omitzero"`
	Detail   string `json:"detail,omitempty"`
}

// Plans describes every resource.
func (l *leader) Plans() []Plan {
	out := make([]Plan, 0, len(l.resources))
	for _, r := range l.resources {
		out = append(out, l.plan(r))
	}
	return out
}

func (l *leader) plan(r string) Plan {
	if l.running != nil && l.running.Resource == r {
		return Plan{Resource: r, State: PlanRunning, Target: l.running.Target}
	}
	target, ok, detail := commonWriteKey(l.members, r)
	if !ok {
		return Plan{Resource: r, State: PlanWaiting, Detail: detail}
	}
	rec, hasRec := l.records[r]
	due := !hasRec || !rec.Verified || !sameTarget(rec.Target, target)
	why := "the common write key changed since the last migration"
	if !hasRec {
		why = "no migration recorded yet"
	} else if sameTarget(rec.Target, target) && !rec.Verified {
		why = "the last migration to it was not verified"
	}
	if inv, ok := l.inventory[r]; ok && (!hasRec || inventoryAfter(inv, rec)) {
		if n := offTarget(inv, target); n > 0 {
			due, why = true, fmt.Sprintf("an inventory counts %d objects under other keys", n)
		} else if !due || !hasRec {
			// A fresh inventory with everything on target is as good as a verified run
			// (for a resource never migrated, adoptInventories records it as one).
			return Plan{Resource: r, State: PlanDone, Target: target}
		}
	}
	if !due {
		return Plan{Resource: r, State: PlanDone, Target: target}
	}
	if at, ok := l.retryAt[r]; ok && l.now.Before(at) {
		return Plan{Resource: r, State: PlanRetrying, Target: target, Detail: fmt.Sprintf("retry in %s after: %s", at.Sub(l.now), rec.Error)}
	}
	if !l.leading {
		return Plan{Resource: r, State: PlanFollowing, Target: target, Detail: why}
	}
	return Plan{Resource: r, State: PlanMigrate, Target: target, Detail: why}
}

// inventoryAfter reports whether inv read etcd after rec's migration ended, by etcd
// revision: the members' clocks may disagree by minutes, revisions cannot. A record
// without a revision (an older rekey's) counts as older than any inventory that has one,
// so a fresh inventory still decides; an inventory without one proves nothing.
func inventoryAfter(inv inventoryTaken, rec Record) bool {
	return inv.Revision > 0 && inv.Revision > rec.Revision
}

// sameTarget reports whether a record's target is the key target: the same key, and
// for KMS the same key id. A record written before check values were published has
// none, so it never matches a local key: that resource is migrated once more.
func sameTarget(rec, target Key) bool {
	return rec.SameKey(target) && rec.KeyIDHash == target.KeyIDHash
}

// offTarget counts the objects an inventory found under keys other than target.
func offTarget(inv inventoryTaken, target Key) int64 {
	var n int64
	for _, c := range inv.Objects {
		if !c.Key.SameEntry(target) || (target.KeyIDHash != "" && c.Key.KeyIDHash != target.KeyIDHash) {
			n += c.Objects
		}
	}
	return n
}

// CommonWriteKey returns the key every live member (by apiserver id) writes resource
// with, or why there is none. The keys must be the same (transformers.KeyInfo.Match:
// provider, name and check value — a record without a check value proves nothing, so
// it never agrees); for KMS the key id hashes must agree too, and be known. A member
// whose fence refuses writes writes with no key.
func CommonWriteKey(members map[string]MemberState, resource string) (Key, bool, string) {
	return commonWriteKey(slices.SortedFunc(maps.Values(members), byAPIServerID), resource)
}

// commonWriteKey is CommonWriteKey over a member list sorted by id. It spells the
// disagreement out only when there is one: the leader asks on every tick.
func commonWriteKey(members []MemberState, resource string) (Key, bool, string) {
	if len(members) == 0 {
		return Key{}, false, "no live member"
	}
	var first Key
	agree, sameNames := true, true
	for i, m := range members {
		w, writing := m.writes(resource)
		if !writing {
			agree, sameNames = false, false
			continue
		}
		if keyIDUnknown(w) {
			agree = false
		}
		if i == 0 {
			first = w
		} else if !w.SameKey(first) || w.KeyIDHash != first.KeyIDHash {
			agree = false
			sameNames = sameNames && w.String() == first.String()
		}
	}
	if agree {
		return first, true, ""
	}
	if sameNames && len(members) > 1 {
		// The names agree: say why they still differ.
		return Key{}, false, "members write with keys of one name whose secrets differ or cannot be compared (a record without a check value): " + checksOf(members, resource)
	}
	parts := make([]string, 0, len(members))
	for _, m := range members {
		if w, writing := m.writes(resource); writing {
			parts = append(parts, m.APIServerID+"="+w.String())
		} else {
			parts = append(parts, m.APIServerID+"=(refusing writes)")
		}
	}
	return Key{}, false, "members write with different keys: " + strings.Join(parts, ", ")
}

// checksOf lists each member's write key with its check value.
func checksOf(members []MemberState, resource string) string {
	parts := make([]string, 0, len(members))
	for _, m := range members {
		w, _ := m.writes(resource)
		check := w.Check
		if check == "" {
			check = "none"
		}
		parts = append(parts, fmt.Sprintf("%s=%s check %s", m.APIServerID, w, check))
	}
	return strings.Join(parts, ", ")
}
