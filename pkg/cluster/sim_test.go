package cluster

import (
	"flag"
	"fmt"
	"maps"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"pgregory.net/rapid"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The cluster machines under random schedules: simMembers apiservers, each with its
// own fence and leader machine, share a simulated etcd (the published member records,
// the migration records, the stored objects). An operator rotates keys the safe way
// (first every file reads the new key, then it is put first), but files reach the
// apiservers with random lags, apiservers see each other's records with random watch
// lags, crash, restart with whatever file they have, and their leases expire a TTL
// after they die. One elected apiserver at a time leads and migrates.
//
// Invariants, checked after every step:
//   - promotion: an apiserver starts writing with a key only when every live member
//     it knows of can read it (a member that joined since its last view is a
//     straggler, not a veto);
//   - one migrator: only the elected leader's machine ever offers a migration, and at
//     most one runs;
//   - verification: the leader calls a resource done only when every object stored
//     up to its evidence (a verified migration or a newer inventory) is under the
//     target.
//
// `go test` runs simShortChecks schedules; REKEY_SIM_FULL=1 (make sim) or
// -rapid.checks=N runs more, and the full run logs the convergence time distribution:
// simulated time from the last configuration change to every live apiserver writing
// with the new key.

const (
	simMembers      = 100
	simResource     = "secrets"
	simObjects      = 300
	simLeaseTTL     = 10 * time.Second
	simStep         = 500 * time.Millisecond
	simShortChecks  = 20
	simFullChecks   = 10000
	simSettleLimit  = 10 * time.Minute
	simMigrateChunk = 50
)

type schedMember struct {
	id       string
	alive    bool
	leaseEnd time.Time // when its record goes, once dead
	file     []Key     // the configuration on its disk (read chain, write key first)
	rules    []transformers.RuleInfo
	fence    *fence
	leader   *leader
	// view is the member list it last saw (shared with the others that saw the same
	// one: never changed); nextSync when it sees the next one.
	view     []MemberState
	nextSync time.Time
	// watchLag and fileLag are how late it sees records and gets files.
	watchLag, fileLag time.Duration
	fileAt            time.Time // when the desired file reaches it (zero: has it)
}

type simObject struct {
	key Key
	rev int64
}

type sched struct {
	t         *rapid.T
	now       time.Time
	rev       int64
	members   []*schedMember
	published map[string]MemberState
	listed    []MemberState // published, sorted; nil when it changed
	records   map[string]Record
	objects   []simObject
	desired   []Key
	nextKey   int
	leaderID  string
	running   *Migration
	cursor    int
	changedAt time.Time
}

func simKey(i int) Key {
	return Key{Provider: transformers.ProviderAESGCM, Key: fmt.Sprintf("k%d", i), Check: fmt.Sprintf("c%d", i)}
}

func newSim(t *rapid.T) *sched {
	s := &sched{t: t, now: epoch, published: map[string]MemberState{}, records: map[string]Record{}, desired: []Key{simKey(0)}, nextKey: 1}
	for i := range simMembers {
		m := &schedMember{id: fmt.Sprintf("m%03d", i), alive: true, file: slices.Clone(s.desired),
			watchLag: time.Duration(rapid.IntRange(10, 500).Draw(t, "watchLag")) * time.Millisecond,
			fileLag:  time.Duration(rapid.IntRange(0, 5000).Draw(t, "fileLag")) * time.Millisecond}
		s.members = append(s.members, m)
	}
	for _, m := range s.members {
		s.start(m)
	}
	for i := range simObjects {
		s.rev++
		_ = i
		s.objects = append(s.objects, simObject{key: simKey(0), rev: s.rev})
	}
	return s
}

// start (re)starts m: a fresh fence and leader, the member list as etcd has it now,
// then its file loaded.
func (s *sched) start(m *schedMember) {
	m.alive, m.rules = true, nil
	m.fence, m.leader = newFence(m.id, s.now), newLeader([]string{simResource}, s.now)
	s.publish(m) // the record comes back before the first view (it is under a new lease)
	s.sync(m)
	s.reload(m)
}

func (s *sched) rulesOf(file []Key) []transformers.RuleInfo {
	return []transformers.RuleInfo{{Resource: simResource, ReadKeys: slices.Clone(file)}}
}

func (s *sched) publish(m *schedMember) {
	st := reload.Status{Resources: m.rules}
	if m.rules == nil {
		st.Resources = nil
	}
	next := stateFromStatus(m.id, "", st, m.fence.HeldSince(), s.now)
	if old, ok := s.published[m.id]; ok && reflect.DeepEqual(old.Resources, next.Resources) {
		return // nothing new: etcd's watch carries no event
	}
	s.published[m.id] = next
	s.listed = nil
	s.rev++
	for _, o := range s.members {
		if o.alive && (o.nextSync.IsZero() || o.nextSync.After(s.now.Add(o.watchLag))) {
			o.nextSync = s.now.Add(o.watchLag)
		}
	}
}

func (s *sched) list() []MemberState {
	if s.listed != nil {
		return s.listed
	}
	// s.members is in id order: no sort needed.
	s.listed = make([]MemberState, 0, len(s.published))
	for _, m := range s.members {
		if st, ok := s.published[m.id]; ok {
			s.listed = append(s.listed, st)
		}
	}
	return s.listed
}

// sync gives m the member list as etcd has it now, and re-asks its fence.
func (s *sched) sync(m *schedMember) {
	list := s.list()
	m.fence.Step(tick{Now: s.now})
	m.fence.Step(membersChanged{Members: list})
	m.leader.Step(tick{Now: s.now})
	m.leader.Step(membersChanged{Members: list})
	m.view = list
	m.nextSync = time.Time{}
	if m.rules != nil {
		s.apply(m, s.rulesOf(m.file))
	}
}

// reload makes m serve its file.
func (s *sched) reload(m *schedMember) { s.apply(m, s.rulesOf(m.file)) }

func (s *sched) apply(m *schedMember, next []transformers.RuleInfo) {
	before, hadWriter := writerOf(m.rules)
	m.rules = applyWriters(next, m.fence.Decide(m.rules, next).Writers)
	after, writing := writerOf(m.rules)
	if writing && (!hadWriter || !after.SameKey(before)) {
		s.checkPromotion(m, after)
	}
	s.publish(m)
}

func writerOf(rules []transformers.RuleInfo) (Key, bool) {
	for _, r := range rules {
		if r.Resource == simResource {
			return r.Writer()
		}
	}
	return Key{}, false
}

// checkPromotion: m starts writing with k; every member of m's view still live must
// read it.
func (s *sched) checkPromotion(m *schedMember, k Key) {
	for _, seen := range m.view {
		id := seen.APIServerID
		st, live := s.published[id]
		if !live || id == m.id {
			continue
		}
		if !st.CanRead(simResource, k) {
			s.t.Fatalf("%s promoted %s at +%s while live member %s cannot read it (its record: %+v)", m.id, k, s.now.Sub(epoch), id, st.Resources)
		}
	}
}

// advance moves the clock by d: leases of dead members expire, files and views arrive.
func (s *sched) advance(d time.Duration) {
	end := s.now.Add(d)
	for s.now.Before(end) {
		s.now = s.now.Add(min(simStep, end.Sub(s.now)))
		for _, m := range s.members {
			if !m.alive && !m.leaseEnd.IsZero() && !s.now.Before(m.leaseEnd) {
				delete(s.published, m.id)
				s.listed = nil
				m.leaseEnd = time.Time{}
				s.rev++
				if s.leaderID == m.id {
					s.leaderID = ""
				}
				for _, o := range s.members {
					if o.alive && o.nextSync.IsZero() {
						o.nextSync = s.now.Add(o.watchLag)
					}
				}
			}
		}
		for _, m := range s.members {
			if !m.alive {
				continue
			}
			if !m.fileAt.IsZero() && !s.now.Before(m.fileAt) {
				m.file, m.fileAt = slices.Clone(s.desired), time.Time{}
				s.reload(m)
			}
			if !m.nextSync.IsZero() && !s.now.Before(m.nextSync) {
				s.sync(m)
			}
		}
		s.elect()
		s.checkLeaders()
	}
}

// change is the operator's next step of a rotation: a new key readable everywhere,
// or (once added) the new key put first. Files reach each member after its lag.
func (s *sched) change() {
	if len(s.desired) > 1 && s.desired[0] != simKey(s.nextKey-1) {
		last := s.desired[len(s.desired)-1]
		s.desired = append([]Key{last}, s.desired[:len(s.desired)-1]...)
	} else {
		s.desired = append(slices.Clone(s.desired), simKey(s.nextKey))
		s.nextKey++
	}
	s.changedAt = s.now
	for _, m := range s.members {
		m.fileAt = s.now.Add(m.fileLag)
	}
}

func (s *sched) crash(m *schedMember) {
	if !m.alive {
		return
	}
	m.alive, m.leaseEnd, m.nextSync = false, s.now.Add(simLeaseTTL), time.Time{}
	if s.leaderID == m.id && s.running != nil {
		s.running = nil // its migration dies with it
	}
}

func (s *sched) restart(m *schedMember) {
	if m.alive {
		return
	}
	if s.leaderID == m.id {
		s.leaderID = "" // a new session: it must win the election again
	}
	if !m.fileAt.IsZero() && !s.now.Before(m.fileAt) {
		m.file, m.fileAt = slices.Clone(s.desired), time.Time{}
	}
	m.leaseEnd = time.Time{}
	s.start(m)
}

// elect gives the leadership to a live member once the last leader's session is gone.
func (s *sched) elect() {
	if s.leaderID != "" {
		return
	}
	for _, m := range s.members {
		if m.alive {
			s.leaderID = m.id
			m.leader.Step(leadership{Leading: true})
			m.leader.Step(recordsLoaded{Records: maps.Clone(s.records)})
			return
		}
	}
}

func (s *sched) leaderMember() *schedMember {
	for _, m := range s.members {
		if m.id == s.leaderID && m.alive {
			return m
		}
	}
	return nil
}

// write stores one object through m.
func (s *sched) write(m *schedMember, i int) {
	if w, ok := writerOf(m.rules); ok && m.alive {
		s.rev++
		s.objects[i] = simObject{key: w, rev: s.rev}
	}
}

// lead lets the leader start a migration, or moves the running one on.
func (s *sched) lead() {
	l := s.leaderMember()
	if l == nil {
		return
	}
	l.leader.Step(tick{Now: s.now})
	if s.running == nil {
		if mig, ok := l.leader.Ready(); ok {
			l.leader.Step(migrationStarted{Migration: mig})
			s.running, s.cursor = &mig, 0
		}
		return
	}
	for end := min(s.cursor+simMigrateChunk, len(s.objects)); s.cursor < end; s.cursor++ {
		if o := s.objects[s.cursor]; !o.key.SameKey(s.running.Target) {
			s.rev++
			s.objects[s.cursor] = simObject{key: s.running.Target, rev: s.rev}
		}
	}
	if s.cursor < len(s.objects) {
		return
	}
	// The verifying re-scan.
	errText := ""
	if n := s.offTarget(s.running.Target, 0); n > 0 {
		errText = fmt.Sprintf("%d objects still stale", n)
	}
	l.leader.Step(migrationFinished{Resource: simResource, Target: s.running.Target, Err: errText, Revision: s.rev})
	s.records[simResource] = l.leader.Records()[simResource]
	s.running = nil
}

// inventory lets the leader count what is stored.
func (s *sched) inventory() {
	l := s.leaderMember()
	if l == nil {
		return
	}
	counts := map[Key]int64{}
	for _, o := range s.objects {
		counts[o.key]++
	}
	inv := inventoryTaken{Resource: simResource, Revision: s.rev, TakenAt: s.now}
	for k, n := range counts {
		inv.Objects = append(inv.Objects, keyCount{Key: k, Objects: n})
	}
	l.leader.Step(inv)
}

// offTarget counts the objects not under target written at or before rev (0: all).
func (s *sched) offTarget(target Key, rev int64) int {
	n := 0
	for _, o := range s.objects {
		if !o.key.SameKey(target) && (rev == 0 || o.rev <= rev) {
			n++
		}
	}
	return n
}

// checkLeaders: followers never offer a migration, one runs at most, and "done" has
// evidence.
func (s *sched) checkLeaders() {
	for _, m := range s.members {
		if !m.alive {
			continue
		}
		if _, ok := m.leader.Ready(); ok && m.id != s.leaderID {
			s.t.Fatalf("%s, not the elected leader (%s), offers a migration", m.id, s.leaderID)
		}
		if _, ok := m.leader.Running(); ok && m.id != s.leaderID {
			s.t.Fatalf("%s runs a migration while %s leads", m.id, s.leaderID)
		}
	}
	l := s.leaderMember()
	if l == nil {
		return
	}
	for _, p := range l.leader.Plans() {
		if p.State != PlanDone {
			continue
		}
		rec, hasRec := l.leader.records[p.Resource]
		inv, hasInv := l.leader.inventory[p.Resource]
		ok := hasRec && rec.Verified && sameTarget(rec.Target, p.Target) && s.offTarget(p.Target, rec.Revision) == 0
		ok = ok || hasInv && offTarget(inv, p.Target) == 0 && s.offTarget(p.Target, inv.Revision) == 0
		if !ok {
			s.t.Fatalf("the leader calls %s done under %s at +%s, but objects stored before its evidence are under other keys", p.Resource, p.Target, s.now.Sub(epoch))
		}
	}
}

// promoted reports whether every live member writes with the desired key.
func (s *sched) promoted() bool {
	for _, m := range s.members {
		if !m.alive {
			continue
		}
		if w, ok := writerOf(m.rules); !ok || !w.SameKey(s.desired[0]) {
			return false
		}
	}
	return true
}

func simChecks() int {
	if os.Getenv("REKEY_SIM_FULL") != "" {
		return simFullChecks
	}
	return simShortChecks
}

func TestClusterMachinesUnderRandomSchedules(t *testing.T) {
	var mu sync.Mutex
	var convergence []time.Duration
	if flagValue("rapid.checks") == "" {
		// rapid takes its number of checks from its flag only.
		if err := flag.Set("rapid.checks", strconv.Itoa(simChecks())); err != nil {
			t.Fatal(err)
		}
		defer func() { _ = flag.Set("rapid.checks", "100") }()
	}
	t.Logf("%s schedules of %d apiservers", flag.Lookup("rapid.checks").Value, simMembers)
	rapid.Check(t, func(t *rapid.T) {
		s := newSim(t)
		steps := rapid.IntRange(10, 40).Draw(t, "steps")
		for range steps {
			switch rapid.IntRange(0, 9).Draw(t, "action") {
			case 0:
				if s.nextKey < 6 {
					s.change()
				}
			case 1:
				s.crash(s.members[rapid.IntRange(0, simMembers-1).Draw(t, "crash")])
			case 2:
				s.restart(s.members[rapid.IntRange(0, simMembers-1).Draw(t, "restart")])
			case 3, 4:
				s.write(s.members[rapid.IntRange(0, simMembers-1).Draw(t, "writer")], rapid.IntRange(0, simObjects-1).Draw(t, "object"))
			case 5, 6:
				s.lead()
			case 7:
				s.inventory()
			default:
				s.advance(time.Duration(rapid.IntRange(1, 5000).Draw(t, "advance")) * time.Millisecond)
			}
			s.checkLeaders()
		}
		// Settle: the operator finishes the rotation, the crashed come back; measure
		// how long after the last change every live apiserver writes with the new key.
		if len(s.desired) > 1 && s.desired[0] != simKey(s.nextKey-1) {
			s.change()
		}
		for _, m := range s.members {
			if !m.alive {
				s.restart(m)
			}
		}
		for !s.promoted() {
			if s.now.Sub(s.changedAt) > simSettleLimit {
				t.Fatalf("not every apiserver writes with %s %s after the last change", s.desired[0], simSettleLimit)
			}
			s.advance(simStep)
		}
		if !s.changedAt.IsZero() {
			mu.Lock()
			convergence = append(convergence, s.now.Sub(s.changedAt))
			mu.Unlock()
		}
	})
	if len(convergence) > 0 {
		slices.Sort(convergence)
		q := func(p float64) time.Duration {
			return convergence[min(int(p*float64(len(convergence))), len(convergence)-1)]
		}
		t.Logf("convergence (simulated time from the last configuration change to every live apiserver promoted) over %d schedules: p50 %s, p90 %s, p99 %s, max %s",
			len(convergence), q(0.5), q(0.9), q(0.99), convergence[len(convergence)-1])
	}
}

// flagValue is a test flag's value as given on the command line ("" when not).
func flagValue(name string) string {
	for _, a := range os.Args[1:] {
		a = strings.TrimLeft(a, "-")
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return ""
}
