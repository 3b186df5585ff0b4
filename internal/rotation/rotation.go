// Package rotation is what `rekey rotate` decides, without I/O: the two edits of the
// encryption configuration (Add puts a new write key first, Remove takes out the keys it
// replaced; see edit.go) and the stages of `rekey rotate --wait`, a state machine in
// etcd raft's shape (no I/O, no goroutines, time comes in through Tick). The driver in
// cmd/rekey reads the file and the cluster's coordination keys, feeds them as events,
// asks Ready what to do, does it (write the first edit; run the guard and write the
// second edit) and reports back.
//
// A rotation runs through four stages after its first edit (the new key first in the
// file, the old one right behind it):
//
//  1. promote — every live apiserver writes the rotated resources with the new key and
//     its write fence holds nothing back;
//  2. migrate — the elected migration leader has a verified record for every rotated
//     resource whose target is the key every member writes with;
//  3. remove  — the keys behind the new write key leave the file (the second edit),
//     once the guard (a fresh inventory and guard.CheckChange, then the backup-retention
//     guard with the largest retention the apiservers publish) allows it; a
//     backup-retention hold past the wait's deadline fails the wait at once, naming
//     the date to run it again;
//  4. ack     — every live apiserver runs the file as it is now (its published
//     configuration hash equals the file's).
//
// The machine keeps no state anywhere else: on start (and so on a resume after an
// interruption) it decides from the file, the cluster and what is stored (an inventory
// the driver takes when Ready asks for it, and the migration leader's records):
//
//   - a rule holds an old key (not identity) behind its write key, objects of its
//     resources are stored under a key behind its write key (plaintext under identity,
//     an older KMS key id), or the leader is migrating one of them: that write key is the
//     rotation in progress, continued from the first stage whose condition does not hold
//     yet (a passed stage is checked again and passes at once), never a second new key;
//   - otherwise, when a live apiserver does not run the file yet: the old key was
//     already removed, so only the acknowledgements are waited for;
//   - otherwise the previous rotation is complete (or the file has no rule writing with a
//     key: first-time encryption) and a new one starts with the first edit.
//
// identity behind a write key is the fallback for values written before encryption, as
// upstream's documentation shows it, not an old key: it stays in the file unless
// Config.RemoveIdentity asks for its removal, which the guard allows once no plaintext
// object is left. A rotation whose resources no live apiserver migrates could never
// finish: the machine refuses it before the first edit and fails a wait during which
// the last such apiserver went away.
package rotation

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Key names one provider entry: provider and key name (KMS: provider name and key id
// hash). Never key material.
type Key = cluster.Key

// Rule is one resources entry of the file, as the rotation sees it.
type Rule struct {
	// Resources are the rule's resource names as written in the file.
	Resources []string
	// Entries are its providers' keys in file order; Entries[0] writes. A KMS v2
	// write entry carries the key id hash the driver's own plugin reports, when known:
	// the key id the rotation waits for.
	Entries []Key
	// Stored are the resources stored under the rule, as the driver resolves them (a
	// wildcard rule to what is actually stored): what the inventory counts and the
	// migration covers.
	Stored []string
}

func (r Rule) name() string { return strings.Join(r.Resources, ",") }

// Stage is where a rotation is.
type Stage int

// The stages, in order. Promote to Ack are the four the output counts.
const (
	StageStart   Stage = iota // reading the file and the cluster to decide
	StageEdit                 // the first edit is being written
	StagePromote              // 1/4
	StageMigrate              // 2/4
	StageRemove               // 3/4
	StageAck                  // 4/4
	StageDone
	StageFailed
)

// Stages is how many stages the output counts.
const Stages = 4

var stageNames = map[Stage]string{StageStart: "start", StageEdit: "edit", StagePromote: "promote", StageMigrate: "migrate",
	StageRemove: "remove", StageAck: "ack", StageDone: "done", StageFailed: "failed"}

func (s Stage) String() string { return stageNames[s] }

// Number is the stage's position out of Stages (0 before the first, Stages+1 after).
func (s Stage) Number() int {
	switch {
	case s < StagePromote:
		return 0
	case s > StageAck:
		return Stages + 1
	}
	return int(s - StagePromote + 1)
}

// Action is what the driver does next.
type Action int

const (
	// ActionWait: nothing to do but observe again.
	ActionWait Action = iota
	// ActionWriteFirstEdit: generate the new key and write it first in the file, then
	// report FirstEditWritten and the file as it is now.
	ActionWriteFirstEdit
	// ActionRemoveOld: run the guard for removing Ready.Remove and, when it allows,
	// write the second edit; report RemoveWritten or RemoveRefused, then the file.
	ActionRemoveOld
	// ActionTakeInventory: count what is stored under the resources of the file's
	// rules and of FileRead.Rotates; report Inventoried or InventoryFailed.
	ActionTakeInventory
	// ActionDone: the rotation is complete (exit 0).
	ActionDone
	// ActionFail: give up with Ready.Err (exit non-zero).
	ActionFail
)

var actionNames = map[Action]string{ActionWait: "wait", ActionWriteFirstEdit: "write-first-edit", ActionRemoveOld: "remove-old",
	ActionTakeInventory: "take-inventory", ActionDone: "done", ActionFail: "fail"}

func (a Action) String() string { return actionNames[a] }

// Event is an input of Step.
type Event interface{ event() }

// FileRead is the file as it is now: its content hash and its rules that a rotation may
// concern (rules writing with a local key or KMS, as --resources narrows them).
type FileRead struct {
	Hash  string
	Rules []Rule
	// Rotates are the resources stored under the rules the first edit would change
	// (rotation.Add's choice, which includes rules writing identity for a first-time
	// encryption).
	Rotates []string
}

// StoredCount is what an inventory counted for one resource.
type StoredCount struct {
	Resource string
	// Objects are all stored objects; Stale those under a key behind the write key
	// (plaintext, an older key, an older KMS key id); Plaintext those under identity.
	Objects, Stale, Plaintext int64
}

// Inventoried reports the inventory ActionTakeInventory asked for: one count per
// resource of the file's rules and of FileRead.Rotates.
type Inventoried struct{ Resources []StoredCount }

// InventoryFailed reports that the inventory could not be taken; it is asked for again
// after Config.GuardRetry.
type InventoryFailed struct{ Reason string }

// ClusterObserved is what etcd holds: the live members and the migration leader's state
// (nil when none was written).
type ClusterObserved struct {
	Members   []cluster.MemberState
	Migration *cluster.MigrationState
	// Prefix is the coordination prefix, for messages.
	Prefix string
}

// FirstEditWritten reports that ActionWriteFirstEdit wrote the file.
type FirstEditWritten struct{}

// RemoveWritten reports that the guard allowed the second edit and it was written.
type RemoveWritten struct{}

// RemoveRefused reports that the guard refused the second edit (Reason says why).
// Guard names the guard that refused when it is one of pkg/guard's (a RefusedError's
// Check; empty for the count of stored objects), and Until, for the backup-retention
// guard, is when the last key it holds may go.
type RemoveRefused struct {
	Reason string
	Guard  guard.Check
	Until  time.Time
}

// EditSkipped reports that the edit handed out was not made because the file changed
// since it was read (another rotate, a person, a pipeline wrote it): the machine waits
// for the file as it is now and decides again, so two edits never stack unseen.
type EditSkipped struct{}

// Tick moves the clock.
type Tick struct{ Now time.Time }

func (FileRead) event()         {}
func (Inventoried) event()      {}
func (InventoryFailed) event()  {}
func (ClusterObserved) event()  {}
func (FirstEditWritten) event() {}
func (RemoveWritten) event()    {}
func (RemoveRefused) event()    {}
func (EditSkipped) event()      {}
func (Tick) event()             {}

// Config configures a Machine.
type Config struct {
	// Timeout bounds the whole wait (--wait-timeout).
	Timeout time.Duration
	// GuardRetry is how long to wait after a refused second edit (or a failed
	// inventory) before asking again.
	GuardRetry time.Duration
	// RemoveIdentity makes the second edit also remove identity from behind the new
	// write key (--remove-identity-fallback); by default it stays as the fallback.
	RemoveIdentity bool
	// MigratorGrace is how long a wait tolerates that no live apiserver migrates a
	// rotated resource (a leader restarting) before it fails.
	MigratorGrace time.Duration
	// ResumeOnly finishes a rotation in progress but never starts one: where a new
	// rotation would start with the first edit, the machine is done instead, having
	// added no key. A controller that recorded a first edit before it restarted uses it,
	// so a rotation that completed while no status could be written is not followed by
	// a second new key.
	ResumeOnly bool
}

// Defaults of Config.
const (
	DefaultGuardRetry    = 5 * time.Second
	DefaultMigratorGrace = 30 * time.Second
)

// Progress is what the progress bar shows.
type Progress struct {
	// Members is how many live apiservers publish their state; Acked how many have done
	// what the stage waits for (promote: write with the new key, nothing held; ack: run
	// the file).
	Members, Acked int
	// Done and Total count the running migration's objects (0/0 when none runs).
	Done, Total int64
}

// Ready is the machine's output.
type Ready struct {
	Action Action
	// Remove names the keys the second edit removes (ActionRemoveOld): local key names,
	// KMS provider names, or "identity".
	Remove []string
	// Err is the error of ActionFail: the stage, what is missing, what to do.
	Err   string
	Stage Stage
	// Target describes the rotation ("secrets: aesgcm/key-…"), empty before it is known.
	Target string
	// Waiting says what the current stage waits for ("" when nothing).
	Waiting  string
	Progress Progress
	// Lines are the transitions since the previous Ready, one line each.
	Lines []string
}

// Machine is the rotation's state machine.
type Machine struct {
	cfg      Config
	start    time.Time
	now      time.Time
	stage    Stage
	file     *FileRead
	cluster  *ClusterObserved
	stored   *Inventoried // the inventory decide works from; nil until taken
	target   []Rule       // rotated rules: Entries[0] the new write key, the rest to remove
	before   []Rule       // the file's rules the first edit was decided on
	inflight bool         // an action was handed out and its result has not come back
	edited   bool         // the first edit was written
	retryAt  time.Time
	refused  string
	// refusedBy is the guard that refused the second edit last (RemoveRefused.Guard).
	refusedBy guard.Check
	// ackRefusedByRetention: an apiserver's backup-retention guard refused the file
	// the ack stage waits for.
	ackRefusedByRetention bool
	// noMigratorSince is when a rotated resource was first seen with no live apiserver
	// migrating it (zero while every one has one).
	noMigratorSince time.Time
	waiting         string
	progress        Progress
	lines           []string
	err             string
}

// New returns a machine started at now.
func New(cfg Config, now time.Time) *Machine {
	if cfg.GuardRetry <= 0 {
		cfg.GuardRetry = DefaultGuardRetry
	}
	if cfg.MigratorGrace <= 0 {
		cfg.MigratorGrace = DefaultMigratorGrace
	}
	return &Machine{cfg: cfg, start: now, now: now}
}

// Step feeds one event.
func (m *Machine) Step(ev Event) {
	switch e := ev.(type) {
	case FileRead:
		e.Rules = slices.Clone(e.Rules)
		m.file = &e
	case ClusterObserved:
		m.cluster = &e
	case Inventoried:
		if m.inflight && m.stage == StageStart {
			m.inflight, m.stored = false, &e
		}
	case InventoryFailed:
		if m.inflight && m.stage == StageStart {
			m.inflight = false
			m.retryAt = m.now.Add(m.cfg.GuardRetry)
			m.linef("taking the inventory failed; asking again in %s: %s", m.cfg.GuardRetry, e.Reason)
		}
	case FirstEditWritten:
		if m.stage == StageEdit {
			// The file read before the edit is stale: wait for it to be read again.
			m.inflight, m.edited, m.file = false, true, nil
		}
	case RemoveWritten:
		if m.stage == StageRemove {
			m.inflight, m.refused, m.refusedBy = false, "", ""
			m.linef("second edit written: %s removed", strings.Join(m.removeNames(), ", "))
			m.file = nil
		}
	case RemoveRefused:
		if m.stage == StageRemove {
			m.inflight = false
			m.retryAt = m.now.Add(m.cfg.GuardRetry)
			if e.Reason != m.refused {
				m.linef("%s refused the second edit; asking again every %s: %s", guardName(e.Guard), m.cfg.GuardRetry, e.Reason)
			}
			m.refused, m.refusedBy = e.Reason, e.Guard
			if deadline := m.start.Add(m.cfg.Timeout); e.Guard == guard.Retention && m.cfg.Timeout > 0 && e.Until.After(deadline) {
				m.fail("stage %d/%d (%s): the backup-retention guard keeps %s in the file until %s, after --wait-timeout ends (%s): %s; "+
					"every apiserver writes with the new key and the migration is verified, so only the removal is left: run `rekey rotate --wait` again after %s",
					m.stage.Number(), Stages, m.stage, strings.Join(m.removeNames(), ", "), e.Until.UTC().Format(time.RFC3339),
					deadline.UTC().Format(time.RFC3339), e.Reason, e.Until.UTC().Format(time.RFC3339))
			}
		}
	case EditSkipped:
		if m.inflight {
			m.inflight, m.file = false, nil
			if m.stage == StageEdit {
				// The first edit was decided on a file that is gone: decide from the
				// new one (it may hold someone else's rotation) and what is stored
				// under it.
				m.stage, m.stored = StageStart, nil
			}
		}
	case Tick:
		if e.Now.After(m.now) {
			m.now = e.Now
		}
	}
	m.advance()
}

// Ready returns what to do now and the lines since the last call. An action other than
// wait is handed out once; the machine waits for its result.
func (m *Machine) Ready() Ready {
	r := Ready{Stage: m.stage, Waiting: m.waiting, Progress: m.progress, Lines: m.lines, Target: describe(m.target)}
	m.lines = nil
	switch {
	case m.stage == StageDone:
		r.Action = ActionDone
	case m.stage == StageFailed:
		r.Action, r.Err = ActionFail, m.err
	case m.inflight, m.file == nil:
	case m.stage == StageStart && m.stored == nil && m.cluster != nil && len(m.cluster.Members) > 0 && !m.now.Before(m.retryAt):
		r.Action, m.inflight = ActionTakeInventory, true
	case m.stage == StageEdit && !m.edited:
		r.Action, m.inflight = ActionWriteFirstEdit, true
	case m.stage == StageRemove && len(m.removeNames()) > 0 && !m.now.Before(m.retryAt):
		r.Action, r.Remove, m.inflight = ActionRemoveOld, m.removeNames(), true
	}
	return r
}

func (m *Machine) linef(format string, args ...any) {
	m.lines = append(m.lines, fmt.Sprintf(format, args...))
}

func describe(rules []Rule) string {
	var s []string
	for _, r := range rules {
		s = append(s, r.name()+": "+r.Entries[0].String())
	}
	return strings.Join(s, "; ")
}

func (m *Machine) enter(s Stage) {
	m.stage = s
	if s >= StagePromote && s <= StageAck {
		m.linef("stage %d/%d %s: %s", s.Number(), Stages, s, stageGoal[s])
	}
}

var stageGoal = map[Stage]string{
	StagePromote: "waiting until every apiserver writes with the new key",
	StageMigrate: "waiting for the migration leader to verify every stored object is under the new key",
	StageRemove:  "removing the old key from the file once the guard allows it",
	StageAck:     "waiting until every apiserver runs the final file",
}

func (m *Machine) fail(format string, args ...any) {
	m.stage, m.inflight = StageFailed, false
	m.err = fmt.Sprintf(format, args...)
}

// advance moves through every stage whose condition holds now.
func (m *Machine) advance() {
	if m.stage == StageDone || m.stage == StageFailed {
		return
	}
	if m.file == nil || m.cluster == nil {
		m.waiting = "reading the file and the cluster"
		m.checkDeadline()
		return
	}
	if m.stage == StageStart && !m.decide() {
		m.checkDeadline()
		return
	}
	if m.stage == StageDone {
		return
	}
	if m.stage == StageEdit {
		if !m.edited {
			m.waiting = "writing the first edit"
			return
		}
		pending := changedRules(m.before, m.file.Rules)
		if len(pending) == 0 {
			// The write happened but the file read back writes every rule as before:
			// someone else replaced it meanwhile.
			m.fail("the file read back after the first edit has no new write key (was it replaced meanwhile?); check it and run `rekey rotate --wait` again")
			return
		}
		if m.target == nil {
			m.target = pending
			m.linef("first edit written: new write key %s; the previous key stays behind it for reads", describe(m.target))
			m.enter(StagePromote)
		}
	}
	if !m.fileFollowsTarget() || !m.migratorsStay() {
		return
	}
	for {
		var ok bool
		switch m.stage {
		case StagePromote:
			ok = m.promoteOK()
		case StageMigrate:
			ok = m.migrateOK()
		case StageRemove:
			names := m.removeNames()
			ok = len(names) == 0
			m.waiting = "the guard and the second edit (removing " + strings.Join(names, ", ") + ")"
			if m.refused != "" {
				m.waiting = guardName(m.refusedBy) + " refused removing " + strings.Join(names, ", ") + ": " + m.refused
			}
		case StageAck:
			ok = m.ackOK()
		}
		if !ok {
			break
		}
		m.waiting = ""
		if m.stage == StageAck {
			m.stage = StageDone
			kept := ""
			if m.identityKept() {
				kept = "; identity stays behind it as the fallback for values written before encryption"
			}
			m.linef("rotation complete: every apiserver runs %s, which writes %s and holds no old key%s", m.file.Hash, describe(m.target), kept)
			if !m.edited {
				// A scheduled job that resumed must not read this as "rotated today".
				m.linef("this run finished an earlier rotation and added no key; run rekey rotate --wait again for a new key")
			}
			return
		}
		m.enter(m.stage + 1)
	}
	m.checkDeadline()
}

// decide picks the rotation in progress, or a new one (see the package comment). It
// reports false while it cannot decide yet.
func (m *Machine) decide() bool {
	if len(m.cluster.Members) == 0 {
		m.waiting = fmt.Sprintf("no live apiserver publishes its state under %s (do the apiservers run with --cluster-coordination and this --coordination-prefix?)", coordination.MembersPrefix(m.cluster.Prefix))
		return false
	}
	if m.stored == nil {
		m.waiting = "taking an inventory of what is stored under the file's rules"
		return false
	}
	if pending, lines := m.inProgress(); len(pending) > 0 {
		if !m.migratorsFor(storedOf(pending)) {
			return true
		}
		m.target = pending
		m.lines = append(m.lines, lines...)
		m.enter(StagePromote)
		return true
	}
	if acked, _ := m.acked(); len(m.file.Rules) > 0 && acked < len(m.cluster.Members) {
		m.target = slices.Clone(m.file.Rules)
		m.linef("resuming the rotation in progress: the old key is already out of the file, but not every apiserver runs it yet; no new key is added")
		m.enter(StageAck)
		return true
	}
	if m.cfg.ResumeOnly {
		m.linef("no rotation is in progress (every apiserver runs %s and no old key is left): nothing to resume, no key added", m.file.Hash)
		m.stage = StageDone
		return true
	}
	if !m.migratorsFor(m.file.Rotates) {
		return true
	}
	m.stage, m.inflight, m.before = StageEdit, false, m.file.Rules
	if len(m.file.Rules) == 0 {
		m.linef("no rule of the file writes with a key: starting with the first edit (first-time encryption)")
	} else {
		m.linef("every apiserver runs %s and no old key is left: starting a new rotation", m.file.Hash)
	}
	for _, c := range m.counts(m.file.Rotates) {
		if c.Plaintext > 0 {
			m.linef("the inventory counts %d of %d objects of %s stored as plaintext", c.Plaintext, c.Objects, c.Resource)
		}
	}
	for _, r := range m.file.Rules {
		if slices.ContainsFunc(r.Entries[1:], isIdentity) {
			counted := fmt.Sprintf("nothing of %s is stored as plaintext", r.name())
			if len(m.counts(r.Stored)) == 0 {
				counted = "the inventory does not cover " + r.name()
			}
			m.linef("identity stays behind %s as the fallback for values written before encryption (%s)%s",
				describe([]Rule{r}), counted, m.identityAdvice())
		}
	}
	return true
}

func (m *Machine) identityAdvice() string {
	if m.cfg.RemoveIdentity {
		return "; --remove-identity-fallback removes it with the old key"
	}
	return "; --remove-identity-fallback would remove it"
}

// inProgress are the file's rules with a rotation in progress, in file order, and the
// lines saying why: an old key behind the write key in the file, objects stored under a
// key behind it (m.stored), or the leader migrating one of their resources.
func (m *Machine) inProgress() ([]Rule, []string) {
	var out, byFile []Rule
	var lines []string
	for _, r := range m.file.Rules {
		if len(oldKeyRules([]Rule{r})) > 0 {
			out, byFile = append(out, r), append(byFile, r)
			continue
		}
		var stale, plaintext int64
		for _, c := range m.counts(r.Stored) {
			stale, plaintext = stale+c.Stale, plaintext+c.Plaintext
		}
		switch {
		case stale > 0 && stale == plaintext && slices.ContainsFunc(r.Entries[1:], isIdentity):
			lines = append(lines, fmt.Sprintf("resuming the first-time encryption in progress: the inventory counts %d objects of %s still stored as plaintext behind %s; no new key is added",
				plaintext, r.name(), describe([]Rule{r})))
		case stale > 0:
			lines = append(lines, fmt.Sprintf("resuming the rotation in progress: the inventory counts %d objects of %s stored under a key behind %s (%d of them plaintext); no new key is added",
				stale, r.name(), describe([]Rule{r}), plaintext))
		case m.migrating(r):
			lines = append(lines, fmt.Sprintf("resuming the rotation in progress: the migration leader is migrating %s to %s; no new key is added",
				m.cluster.Migration.Running.Resource, m.cluster.Migration.Running.Target))
		default:
			continue
		}
		out = append(out, r)
	}
	if len(byFile) > 0 {
		lines = append([]string{fmt.Sprintf("resuming the rotation in progress: the file already writes %s with an old key behind it; no new key is added", describe(byFile))}, lines...)
	}
	return out, lines
}

// migrating reports whether the leader runs a migration of one of r's resources.
func (m *Machine) migrating(r Rule) bool {
	mig := m.cluster.Migration
	return mig != nil && mig.Running != nil && slices.Contains(r.Stored, mig.Running.Resource)
}

// counts are the inventory's counts of resources.
func (m *Machine) counts(resources []string) []StoredCount {
	var out []StoredCount
	for _, c := range m.stored.Resources {
		if slices.Contains(resources, c.Resource) {
			out = append(out, c)
		}
	}
	return out
}

// migratorsFor checks up front that a live apiserver migrates each of resources, and
// fails the rotation otherwise: it could never finish. A member whose record does not
// say (an older version) may migrate them, so the check is left to the wait.
func (m *Machine) migratorsFor(resources []string) bool {
	missing, known := m.unmigrated(resources)
	if !known || len(missing) == 0 {
		return true
	}
	m.fail("%s; nothing was edited", m.noMigratorText(missing))
	return false
}

// migratorsStay fails a wait during which no live apiserver migrates a rotated
// resource for longer than Config.MigratorGrace: stage 2 would wait for a migration
// nobody runs.
func (m *Machine) migratorsStay() bool {
	if m.stage != StagePromote && m.stage != StageMigrate {
		return true
	}
	missing, known := m.unmigrated(storedOf(m.target))
	if !known || len(missing) == 0 {
		m.noMigratorSince = time.Time{}
		return true
	}
	if m.noMigratorSince.IsZero() {
		m.noMigratorSince = m.now
	}
	if m.now.Sub(m.noMigratorSince) < m.cfg.MigratorGrace {
		return true
	}
	m.fail("at stage %d/%d (%s): %s; once one does, run `rekey rotate --wait` again to continue", m.stage.Number(), Stages, m.stage, m.noMigratorText(missing))
	return false
}

// unmigrated are the resources no live member migrates; known is false when a live
// member's record does not say what it migrates.
func (m *Machine) unmigrated(resources []string) (missing []string, known bool) {
	for _, mem := range m.cluster.Members {
		if mem.StorageMigration == nil {
			return nil, false
		}
	}
	for _, res := range resources {
		if !slices.ContainsFunc(m.cluster.Members, func(mem cluster.MemberState) bool { ok, _ := mem.Migrates(res); return ok }) {
			missing = append(missing, res)
		}
	}
	return missing, true
}

func (m *Machine) noMigratorText(missing []string) string {
	return fmt.Sprintf("no live apiserver migrates %s, so the rotation could never finish: run the apiservers with --storage-migration=true and %s in --storage-migration-resources (or migrate with `rekey migrate` and rotate step by step: `rekey rotate`, then `rekey rotate --remove-old`)",
		strings.Join(missing, ", "), strings.Join(missing, ","))
}

// storedOf are the resources stored under rules.
func storedOf(rules []Rule) []string {
	var out []string
	for _, r := range rules {
		for _, res := range r.Stored {
			if !slices.Contains(out, res) {
				out = append(out, res)
			}
		}
	}
	return out
}

// changedRules are the rules of after whose write key is not the one the same rule
// had in before (a rule absent from before wrote identity: first-time encryption).
func changedRules(before, after []Rule) []Rule {
	var out []Rule
	for _, r := range after {
		i := slices.IndexFunc(before, func(b Rule) bool { return slices.Equal(b.Resources, r.Resources) })
		if i < 0 || !before[i].Entries[0].SameKey(r.Entries[0]) {
			out = append(out, r)
		}
	}
	return out
}

// oldKeyRules are the rules with an old key behind their write key: any key but the
// identity fallback.
func oldKeyRules(rules []Rule) []Rule {
	var out []Rule
	for _, r := range rules {
		if slices.ContainsFunc(r.Entries[min(1, len(r.Entries)):], func(k Key) bool { return !isIdentity(k) }) {
			out = append(out, r)
		}
	}
	return out
}

func isIdentity(k Key) bool { return k.Provider == transformers.ProviderIdentity }

// identityKept reports whether identity stays behind a rotated rule's write key.
func (m *Machine) identityKept() bool {
	for _, r := range m.targetRulesInFile() {
		if slices.ContainsFunc(r.Entries[1:], isIdentity) {
			return true
		}
	}
	return false
}

// targetRulesInFile are the file's current versions of the rotated rules.
func (m *Machine) targetRulesInFile() []Rule {
	var out []Rule
	for _, t := range m.target {
		for _, r := range m.file.Rules {
			if slices.Equal(r.Resources, t.Resources) {
				out = append(out, r)
			}
		}
	}
	return out
}

// fileFollowsTarget fails the rotation when the file no longer writes the rotated rules
// with the new key: someone edited it under the rotation.
func (m *Machine) fileFollowsTarget() bool {
	for _, t := range m.target {
		i := slices.IndexFunc(m.file.Rules, func(r Rule) bool { return slices.Equal(r.Resources, t.Resources) })
		if i < 0 {
			m.fail("the file changed during the rotation: the rule for %s is gone; check the file and run `rekey rotate --wait` again to follow it as it is", t.name())
			return false
		}
		if w := m.file.Rules[i].Entries[0]; !w.SameKey(t.Entries[0]) {
			m.fail("the file changed during the rotation: %s is now written with %s, the rotation was to %s; check the file and run `rekey rotate --wait` again to follow it as it is", t.name(), w, t.Entries[0])
			return false
		}
	}
	return true
}

// removeNames names the keys behind the new write keys, as --remove-old takes them:
// identity only with Config.RemoveIdentity.
func (m *Machine) removeNames() []string {
	var out []string
	for _, r := range m.targetRulesInFile() {
		for _, k := range r.Entries[1:] {
			n := k.Key
			if isIdentity(k) {
				if !m.cfg.RemoveIdentity {
					continue
				}
				n = transformers.ProviderIdentity
			}
			if !slices.Contains(out, n) {
				out = append(out, n)
			}
		}
	}
	return out
}

// promoteOK: every live member writes every rotated resource with the new key and
// holds nothing back.
func (m *Machine) promoteOK() bool {
	members := m.cluster.Members
	m.progress = Progress{Members: len(members)}
	var missing []string
	for _, mem := range members {
		ok := true
		for _, t := range m.target {
			for _, res := range t.Resources {
				rule, _ := mem.Rule(res)
				want := t.Entries[0]
				switch {
				case want.KeyIDHash != "" && rule.Write.SameKey(want) && rule.Write.KeyIDHash != want.KeyIDHash:
					ok = false
					why := "its plugin has not reported it yet"
					if rule.Held != nil && rule.Held.KeyIDHash == want.KeyIDHash {
						why = "its key-id fence waits until every apiserver's plugin reports it"
					}
					missing = append(missing, fmt.Sprintf("%s writes %s under the KMS key id %s, not yet %s (%s)",
						mem.APIServerID, res, dash(rule.Write.KeyIDHash), want.KeyIDHash, why))
				case rule.Held != nil && rule.Held.SameKey(t.Entries[0]) && !rule.Write.SameKey(t.Entries[0]):
					ok = false
					missing = append(missing, fmt.Sprintf("%s holds %s back for %s (its fence waits for the apiservers that cannot read it yet)", mem.APIServerID, rule.Held, res))
				case !rule.Write.SameKey(t.Entries[0]):
					ok = false
					if slices.ContainsFunc(rule.Read, t.Entries[0].SameKey) {
						missing = append(missing, fmt.Sprintf("%s writes %s with %s", mem.APIServerID, res, rule.Write))
					} else {
						missing = append(missing, fmt.Sprintf("%s writes %s with %s and its file does not have the new key yet", mem.APIServerID, res, rule.Write))
					}
				case rule.Held != nil:
					ok = false
					missing = append(missing, fmt.Sprintf("%s holds %s back for %s", mem.APIServerID, rule.Held, res))
				}
			}
		}
		if ok {
			m.progress.Acked++
		}
	}
	if len(members) == 0 {
		m.waiting = "no live apiserver publishes its state"
		return false
	}
	m.waiting = strings.Join(dedupe(missing), "; ")
	return len(missing) == 0
}

// migrateOK: the leader verified every rotated resource (what is stored under the
// rotated rules, Rule.Stored) on the key every member writes it with.
func (m *Machine) migrateOK() bool {
	mig := m.cluster.Migration
	m.progress = Progress{Members: len(m.cluster.Members), Acked: len(m.cluster.Members)}
	byID := map[string]cluster.MemberState{}
	for _, mem := range m.cluster.Members {
		byID[mem.APIServerID] = mem
	}
	var missing []string
	for _, t := range m.target {
		for _, res := range t.Stored {
			common, ok, why := cluster.CommonWriteKey(byID, res)
			if !ok {
				missing = append(missing, res+": "+why)
				continue
			}
			if mig == nil {
				missing = append(missing, fmt.Sprintf("%s: no migration leader has written %s yet", res, coordination.MigrationState(m.cluster.Prefix)))
				continue
			}
			if mig.Running != nil && mig.Running.Resource == res {
				s := fmt.Sprintf("%s: migrating to %s", res, mig.Running.Target)
				if p := mig.Progress; p != nil && p.Resource == res {
					s += fmt.Sprintf(" %d/%d", p.Done, p.Total)
					m.progress.Done, m.progress.Total = p.Done, p.Total
				}
				missing = append(missing, s)
				continue
			}
			if i := slices.IndexFunc(mig.Plans, func(p cluster.Plan) bool { return p.Resource == res }); i >= 0 && mig.Plans[i].State != cluster.PlanDone {
				p := mig.Plans[i]
				s := fmt.Sprintf("%s: migration %s", res, p.State)
				if p.Detail != "" {
					s += " (" + p.Detail + ")"
				}
				missing = append(missing, s)
				continue
			}
			rec, ok := mig.Records[res]
			switch {
			case !ok:
				missing = append(missing, fmt.Sprintf("%s: no migration recorded yet", res))
			case rec.Target != common:
				missing = append(missing, fmt.Sprintf("%s: the last migration was to %s, not %s", res, rec.Target, common))
			case !rec.Verified:
				missing = append(missing, fmt.Sprintf("%s: the migration to %s is not verified: %s", res, common, rec.Error))
			}
		}
	}
	m.waiting = strings.Join(missing, "; ")
	return len(missing) == 0
}

// acked counts the live members that run the file as it is now.
func (m *Machine) acked() (int, []string) {
	n := 0
	var missing []string
	m.ackRefusedByRetention = false
	for _, mem := range m.cluster.Members {
		if mem.ConfigHash == m.file.Hash {
			n++
			continue
		}
		s := fmt.Sprintf("%s runs %s", mem.APIServerID, short(mem.ConfigHash))
		if hold, ok := guard.RetentionRefusal(mem.LastReloadError); ok {
			m.ackRefusedByRetention = true
			s += " and its backup-retention guard refused a newer file"
			if hold != "" {
				s += ": " + hold
			}
		} else if mem.LastReloadError != "" {
			first, _, _ := strings.Cut(mem.LastReloadError, "\n")
			s += " and refused a newer file: " + first
		}
		missing = append(missing, s)
	}
	return n, missing
}

func (m *Machine) ackOK() bool {
	n, missing := m.acked()
	m.progress = Progress{Members: len(m.cluster.Members), Acked: n}
	if len(m.cluster.Members) == 0 {
		m.waiting = "no live apiserver publishes its state"
		return false
	}
	m.waiting = ""
	if len(missing) > 0 {
		m.waiting = fmt.Sprintf("the file is %s; %s", short(m.file.Hash), strings.Join(missing, "; "))
	}
	return len(missing) == 0
}

// checkDeadline fails a wait that outlived the timeout, saying where it stopped.
func (m *Machine) checkDeadline() {
	if m.cfg.Timeout <= 0 || m.stage == StageDone || m.stage == StageFailed || m.now.Sub(m.start) < m.cfg.Timeout {
		return
	}
	where := "before the first stage"
	if n := m.stage.Number(); n > 0 {
		where = fmt.Sprintf("at stage %d/%d (%s)", n, Stages, m.stage)
	}
	m.fail("not complete after %s, %s: %s; %s; run `rekey rotate --wait` again to continue from there",
		m.cfg.Timeout, where, dash(m.waiting), m.advice())
}

// advice is what to do about the stage the wait stopped at.
func (m *Machine) advice() string {
	switch {
	case m.stage == StageRemove && m.refusedBy == guard.Retention:
		return "the backup-retention guard keeps the old key while an etcd snapshot within the largest --backup-retention (this command's or an apiserver's) may need it; `rekey ledger` shows when it retired"
	case m.stage == StageRemove && m.refusedBy != "":
		return "the " + string(m.refusedBy) + " guard refused the removal; its message says what it waits for"
	case m.stage == StageAck && m.ackRefusedByRetention:
		return "an apiserver's backup-retention guard refused the final file (an etcd snapshot within its --backup-retention may need the old key): put the old key back behind the write key, then run `rekey rotate --wait` again, which removes it once that retention lets it go"
	}
	return advice[m.stage]
}

// guardName names the guard that refused the second edit.
func guardName(c guard.Check) string {
	switch c {
	case "":
		return "the guard"
	case guard.Retention:
		return "the backup-retention guard"
	}
	return "the " + string(c) + " guard"
}

var advice = map[Stage]string{
	StageStart:   "check that the apiservers run with cluster coordination under this --coordination-prefix (`rekey status`)",
	StageEdit:    "check the file",
	StagePromote: "install the file on every apiserver (a mounted Secret reaches each node after the kubelet's sync period) and check `rekey status`",
	StageMigrate: "check the migration leader's state with `rekey status` and its log",
	StageRemove:  "the guard counts stored objects still under the old key; check `rekey inventory` and the migration",
	StageAck:     "install the final file on every apiserver; an apiserver that refused it says why in `rekey status`",
}

func short(h string) string {
	if len(h) > len("sha256:")+12 {
		return h[:len("sha256:")+12]
	}
	if h == "" {
		return "no configuration hash"
	}
	return h
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func dedupe(s []string) []string {
	var out []string
	for _, x := range s {
		if !slices.Contains(out, x) {
			out = append(out, x)
		}
	}
	return out
}
