// Package state is the KMS v2 DEK/seed lifecycle as a pure state machine: no goroutines,
// no I/O, no clock of its own. The caller (the provider's driver loop) feeds it time with
// Tick, plugin results with Step, runs the RPCs that Ready asks for, and publishes View.
//
//	m := state.New(state.Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed}, now)
//	for {
//		for _, a := range m.Ready() { /* run a.Kind's RPC, then m.Step(result) */ }
//		publish(m.View())
//		sleepUntil(m.View().NextWake); m.Tick(clock.Now())
//	}
//
// Rules (kube-apiserver's, with kubernetes/kubernetes#138950 fixed):
//   - Status runs every StatusInterval while healthy, every RetryInterval otherwise.
//   - A Status is fully healthy when healthz is "ok", the version is v2 or v2beta1 and
//     the same as the first accepted one, and the key id is valid.
//   - Only a fully healthy Status extends the write expiry, to its arrival + WriteTTL.
//     An unhealthy Status never does, so writes stop WriteTTL after the last healthy one.
//   - A new DEK source (Encrypt) is requested only when a fully healthy Status reports
//     a key id different from the write state's. The Encrypt key id must equal that
//     Status key id.
//   - A failed rotation keeps the old write state with its old expiry.
//   - With Config.Fenced (many apiservers, one cluster), a new key id reported while a
//     write state exists is held: the machine keeps writing with its current DEK source
//     (wrapped under the old key id, which every plugin can still decrypt), a healthy
//     Status extends that write state as usual, and it rotates only after the driver
//     steps WriteAllowed for the held key id (every other apiserver's plugin reports
//     it). The first write state cannot be fenced that way (there is no older one to
//     write with): with Config.FirstSeedHold it is taken, but writes wait until
//     WriteAllowed names its key id, for at most FirstSeedHold.
//   - A DEK seed is refreshed while the key id is stable: once it is SeedMaxAge old
//     (counted from its Encrypt answer) or has encrypted SeedMaxWrites values (the
//     driver reports the count with SeedWrites), a new one is asked for under the same
//     key id, exactly as for a key id change. Writes keep the old seed meanwhile and a
//     bound never stops a write; a refresh waits for a healthy plugin, for a write state
//     that can still write, and for no key id held by the fence. A failed refresh is a
//     failed rotation (unhealthy, old seed kept) and is asked again after the next
//     healthy Status. The new seed's expiry counts from the last healthy Status, so a
//     refresh never lengthens the write window.
//
// Key id hygiene (docs/kms-plugin.md, "Key ids that move"):
//   - A key id other than the write state's acts (a new DEK source, a fence hold) only
//     once Config.KeyIDConfirmations consecutive healthy Status answers reported it and
//     an Encrypt answered with it. Meanwhile the write state keeps writing and each of
//     those Statuses extends it: a plugin that flaps for less than that causes no new
//     DEK source, no hold and no migration. A write state that can no longer write (the
//     first one, or one expired in an outage) has nothing to keep writing with: a new
//     key id is taken at the first healthy Status then, as before.
//   - An Encrypt whose key id differs from the Status key id it was asked for is a
//     disagreement: counted (View.Disagreements) and described, never followed. A
//     write state that can still write keeps writing and the plugin stays healthy; the
//     first DEK source cannot be taken, which leaves the provider unhealthy as before.
//   - A reuse is a key id that was superseded coming back as the plugin's current one:
//     one this machine wrote with and then replaced by another key id, or one the
//     driver names as superseded (Superseded, from the cluster's key ledger). KMS v2
//     forbids it and the machine cannot tell whether the material behind it is the old
//     one, so it refuses to write under it: the write state keeps writing while it
//     can (its expiry extended by each healthy Status), no Encrypt is asked for, and
//     View.Reused names it until the plugin reports a key id that is not a reuse.
//     Reads are never affected.
package state

import (
	"errors"
	"fmt"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// Defaults, the same as kube-apiserver's.
const (
	DefaultStatusInterval = time.Minute
	DefaultRetryInterval  = 10 * time.Second
	DefaultWriteTTL       = 3 * time.Minute
)

// Accepted Status versions.
const (
	VersionV2      = "v2"
	VersionV2beta1 = "v2beta1"
)

// Config parameterises a Machine. Zero durations take the defaults.
type Config struct {
	Provider       string
	WriteType      wire.SourceType
	StatusInterval time.Duration
	RetryInterval  time.Duration
	WriteTTL       time.Duration
	// Fenced holds a new key id back until WriteAllowed (see the package rules).
	Fenced bool
	// FirstSeedHold, with Fenced, holds writes under the first DEK source of the
	// machine (a start, or a provider built by a reload) until WriteAllowed names its
	// key id, for at most this long; then writes go ahead under it (View.
	// FirstSeedHoldExpired). Zero: the first DEK source writes at once.
	FirstSeedHold time.Duration
	// SeedMaxAge and SeedMaxWrites bound how long and for how many values one DEK seed
	// is used while the key id is stable (see the package rules). Zero: no bound.
	SeedMaxAge    time.Duration
	SeedMaxWrites uint64
	// KeyIDConfirmations is how many consecutive healthy Status answers must report a
	// new key id before it acts (see the package rules). 0 and 1: the first one does.
	KeyIDConfirmations int
}

// maxRetired bounds the key ids a machine remembers as superseded by its own rotations.
const maxRetired = 64

// Why a new DEK seed was made under an unchanged key id (WriteState.Refresh).
const (
	RefreshAge    = "age"
	RefreshWrites = "writes"
)

// Kind is an RPC the machine asks the driver to run.
type Kind int

const (
	// CallStatus: run Status and Step a StatusResult.
	CallStatus Kind = iota + 1
	// CallEncrypt: make a fresh DEK source of Action.Type, Encrypt it and Step an
	// EncryptResult carrying the same Action.Seq.
	CallEncrypt
)

func (k Kind) String() string {
	switch k {
	case CallStatus:
		return "Status"
	case CallEncrypt:
		return "Encrypt"
	}
	return "none"
}

// Action is one RPC to run.
type Action struct {
	Kind Kind
	// Seq pairs an Encrypt with its result; stale results are ignored.
	Seq  uint64
	Type wire.SourceType
}

// Event is an input to Step: StatusResult, EncryptResult or HealthCheckRequested. The
// set is closed, so a Step cannot be handed something the machine does not know.
type Event interface{ isEvent() }

func (StatusResult) isEvent()         {}
func (EncryptResult) isEvent()        {}
func (HealthCheckRequested) isEvent() {}
func (WriteAllowed) isEvent()         {}
func (SeedWrites) isEvent()           {}
func (Superseded) isEvent()           {}

// StatusResult is the outcome of a Status RPC. At is when it was asked: the answer describes
// the plugin as of then, and a later stamp would let a slow answer look fresher than it is.
type StatusResult struct {
	At      time.Time
	Err     error
	Version string
	Healthz string
	KeyID   string
}

// EncryptResult is the outcome of an Encrypt RPC for Action Seq.
type EncryptResult struct {
	At  time.Time
	Seq uint64
	Err error
	// Source is the plaintext DEK source (seed or key) that was encrypted; the machine
	// keeps it only as an opaque value for the driver.
	Source      Secret
	KeyID       string
	Ciphertext  []byte
	Annotations map[string][]byte
}

// HealthCheckRequested asks for a Status as soon as none is in flight (a health check
// found the cached result too old).
type HealthCheckRequested struct{}

// WriteAllowed opens the write fence for KeyID (Config.Fenced): every other apiserver's
// plugin reports it, so values written under it are readable everywhere. It rotates at
// once if KeyID is the held key id and the plugin is healthy, and is ignored otherwise
// (the plugin moved on, nothing is held, or an unhealthy plugin must not rotate: the
// driver asks again after the next healthy Status).
type WriteAllowed struct {
	At    time.Time
	KeyID string
}

// SeedWrites reports how many values the write state of Generation has encrypted so far
// (Config.SeedMaxWrites). A count for another generation is ignored.
type SeedWrites struct {
	At         time.Time
	Generation uint64
	Writes     uint64
}

// Superseded names the key ids, by KeyIDHash, that were written with and then replaced
// by another key id of this provider (the cluster's key ledger knows them): one of them
// reported again by the plugin is a reuse. It replaces the previous set.
type Superseded struct {
	At          time.Time
	KeyIDHashes []string
}

// WriteState is what new values are written with. It is immutable once published (the
// machine never changes one it has handed out, nor the slices in it); a new expiry
// produces a new WriteState value with the same Generation.
type WriteState struct {
	// Generation increases with every new DEK source.
	Generation  uint64
	KeyID       string
	Type        wire.SourceType
	Ciphertext  []byte
	Annotations []wire.Annotation
	Source      Secret
	Expiry      time.Time
	// Created is when the plugin's Encrypt of this DEK source answered (its age counts
	// from then).
	Created time.Time
	// Refresh is why it replaced a DEK source of the same key id (RefreshAge,
	// RefreshWrites); empty for the first one and after a key id change.
	Refresh string
}

// View is the read-only outcome: what may be written with, until when, and why not.
type View struct {
	Now time.Time
	// Write is the current write state, nil before the first successful rotation. It
	// stays set after expiry so reads keep knowing what is current (stale flag).
	Write *WriteState
	// CanWrite: Write is set and Now is before its expiry.
	CanWrite bool
	// Healthy: the last Status was fully healthy and no rotation it asked for failed.
	Healthy bool
	// Err is why the provider is unhealthy (nil when healthy).
	Err error
	// HealthAt is when Healthy/Err were last decided (zero before any Status).
	HealthAt time.Time
	// LastStatus is when the plugin last answered Status (zero if never).
	LastStatus time.Time
	// LastHealthy is when the last fully healthy Status arrived.
	LastHealthy time.Time
	// NextWake is when the driver must Tick next.
	NextWake time.Time
	// Rotating: an Encrypt is in flight.
	Rotating bool
	// Reported is the key id of the last fully healthy Status: the key id this
	// apiserver's plugin can decrypt (and would encrypt with). Empty before one.
	Reported string
	// Held is the key id the write fence holds back (Config.Fenced), empty when none;
	// HeldSince is when the first healthy Status reported it.
	Held      string
	HeldSince time.Time
	// FirstSeedHeld: Write is the machine's first DEK source and must not write yet
	// (Config.FirstSeedHold), until FirstSeedHeldUntil at the latest.
	FirstSeedHeld      bool
	FirstSeedHeldUntil time.Time
	// FirstSeedHoldExpired: the first DEK source's hold ended at its bound, not by
	// WriteAllowed (writes go ahead under a key id not every plugin reported).
	FirstSeedHoldExpired bool
	// SeedWrites is the last count of values Write has encrypted (SeedWrites events).
	SeedWrites uint64
	// RefreshDue is why Write's DEK seed is due for a refresh (RefreshAge,
	// RefreshWrites), empty when it is not.
	RefreshDue string
	// Candidate is a new key id healthy Statuses report that has not acted yet
	// (Config.KeyIDConfirmations): CandidateSeen consecutive Statuses reported it, the
	// first at CandidateSince. Empty when none.
	Candidate      string
	CandidateSeen  int
	CandidateSince time.Time
	// Reused is a superseded key id the plugin reports as its current one, refused as
	// a write key since ReusedSince (see the package rules); empty when none. Reuses
	// counts the times a reuse started.
	Reused      string
	ReusedSince time.Time
	Reuses      uint64
	// Disagreements counts Encrypt answers whose key id differed from the Status key id
	// they were asked for; Disagreement describes the last one (key ids as hashes).
	Disagreements uint64
	Disagreement  string
}

// Machine is the lifecycle state. Not safe for concurrent use; one driver owns it.
type Machine struct {
	cfg Config
	now time.Time

	write *WriteState

	version        string // first accepted Status version
	healthy        bool
	err            error
	healthAt       time.Time
	lastStatus     time.Time
	lastHealthy    time.Time
	nextStatus     time.Time
	statusInFlight bool

	seq             uint64
	encryptInFlight bool
	// pending rotation: the healthy Status that asked for it.
	rotKeyID  string
	rotStatus time.Time
	rotQueued bool

	// reported is the key id of the last fully healthy Status.
	reported string
	// held is the key id the fence holds back; heldSince its first healthy Status,
	// heldStatus its latest (the rotation's expiry counts from it).
	held                  string
	heldSince, heldStatus time.Time

	generation uint64

	// firstHeldUntil is set while the first DEK source is held (Config.FirstSeedHold);
	// firstExpired records that the hold ended at its bound.
	firstHeldUntil time.Time
	firstExpired   bool

	// seedWrites is the last SeedWrites count of the current write state; rotReason
	// is why the queued or running Encrypt was asked for when it is a refresh.
	seedWrites uint64
	rotReason  string

	// candidate is a new key id not yet confirmed by KeyIDConfirmations Statuses.
	candidate      string
	candidateSeen  int
	candidateSince time.Time
	// retired lists the key ids this machine wrote with and replaced by another (most
	// recent last, at most maxRetired); superseded holds the driver's (Superseded).
	retired    []string
	superseded map[string]bool
	// reused is the refused key id (a reuse) the plugin reports, since reusedSince.
	reused      string
	reusedSince time.Time
	reuses      uint64

	disagreements uint64
	disagreement  string
}

// New returns a machine that asks for a Status at once.
func New(cfg Config, now time.Time) *Machine {
	if cfg.StatusInterval <= 0 {
		cfg.StatusInterval = DefaultStatusInterval
	}
	if cfg.RetryInterval <= 0 {
		cfg.RetryInterval = DefaultRetryInterval
	}
	if cfg.WriteTTL <= 0 {
		cfg.WriteTTL = DefaultWriteTTL
	}
	// An unreachable plugin is never asked less often than a healthy one.
	cfg.RetryInterval = min(cfg.RetryInterval, cfg.StatusInterval)
	return &Machine{cfg: cfg, now: now, nextStatus: now, err: errors.New("no Status response from the KMS plugin yet")}
}

// Tick advances the machine's clock (time never goes backwards) and asks for a DEK
// seed refresh that has come due.
func (m *Machine) Tick(now time.Time) {
	m.advance(now)
	m.maybeRefresh()
}

// advance is Tick without the refresh: an event looks at the refresh after it changed
// the state (a Status may report another key id, which then rotates instead).
func (m *Machine) advance(now time.Time) {
	if now.After(m.now) {
		m.now = now
	}
	if !m.firstHeldUntil.IsZero() && !m.now.Before(m.firstHeldUntil) {
		m.firstHeldUntil, m.firstExpired = time.Time{}, true
	}
}

// refreshDue says why the current DEK seed has reached a bound, or "".
func (m *Machine) refreshDue() string {
	w := m.write
	switch {
	case w == nil:
		return ""
	case m.cfg.SeedMaxAge > 0 && !m.now.Before(w.Created.Add(m.cfg.SeedMaxAge)):
		return RefreshAge
	case m.cfg.SeedMaxWrites > 0 && m.seedWrites >= m.cfg.SeedMaxWrites:
		return RefreshWrites
	}
	return ""
}

// refreshBlocked: a due refresh waits (see the package rules). A key id the plugin no
// longer reports is replaced by the key id change itself.
func (m *Machine) refreshBlocked() bool {
	w := m.write
	return !m.healthy || m.encryptInFlight || m.rotQueued || m.held != "" || m.candidate != "" || m.reused != "" ||
		w == nil || m.reported != w.KeyID || !m.now.Before(w.Expiry)
}

// maybeRefresh queues a new DEK seed under the current key id when one is due.
func (m *Machine) maybeRefresh() {
	reason := m.refreshDue()
	if reason == "" || m.refreshBlocked() {
		return
	}
	m.rotKeyID, m.rotStatus, m.rotQueued, m.rotReason = m.write.KeyID, m.lastHealthy, true, reason
}

// Ready returns the RPCs to run now and marks them in flight. The slice is the
// caller's: the machine keeps no reference to it.
func (m *Machine) Ready() []Action {
	var actions []Action
	if m.rotQueued && !m.encryptInFlight {
		m.rotQueued = false
		m.encryptInFlight = true
		m.seq++
		actions = append(actions, Action{Kind: CallEncrypt, Seq: m.seq, Type: m.cfg.WriteType})
	}
	if !m.statusInFlight && !m.encryptInFlight && !m.now.Before(m.nextStatus) {
		m.statusInFlight = true
		actions = append(actions, Action{Kind: CallStatus})
	}
	return actions
}

// Step feeds one input. It fails only for a nil Event.
func (m *Machine) Step(ev Event) error {
	switch e := ev.(type) {
	case StatusResult:
		m.advance(e.At)
		m.stepStatus(e)
	case EncryptResult:
		m.advance(e.At)
		m.stepEncrypt(e)
	case HealthCheckRequested:
		if m.nextStatus.After(m.now) {
			m.nextStatus = m.now
		}
	case SeedWrites:
		if m.write != nil && e.Generation == m.write.Generation && e.Writes > m.seedWrites {
			m.seedWrites = e.Writes
		}
		m.Tick(e.At)
	case WriteAllowed:
		m.Tick(e.At)
		if !m.firstHeldUntil.IsZero() && m.write != nil && e.KeyID == m.write.KeyID {
			m.firstHeldUntil = time.Time{}
		}
		if m.held != "" && e.KeyID == m.held && m.healthy && !m.encryptInFlight && !m.rotQueued {
			m.rotKeyID, m.rotStatus, m.rotQueued = m.held, m.heldStatus, true
			m.held, m.heldSince, m.heldStatus = "", time.Time{}, time.Time{}
		}
	case Superseded:
		m.Tick(e.At)
		m.superseded = make(map[string]bool, len(e.KeyIDHashes))
		for _, h := range e.KeyIDHashes {
			m.superseded[h] = true
		}
	default:
		return fmt.Errorf("kms v2 state: unknown event %T", ev)
	}
	return nil
}

func (m *Machine) setHealth(at time.Time, err error) {
	m.healthAt = at
	m.err = err
	m.healthy = err == nil
	interval := m.cfg.StatusInterval
	if err != nil {
		interval = m.cfg.RetryInterval
	}
	m.nextStatus = at.Add(interval)
}

func (m *Machine) stepStatus(e StatusResult) {
	m.statusInFlight = false
	if e.Err != nil {
		m.setHealth(e.At, fmt.Errorf("failed to perform status section of the healthz check for KMS Provider %s, error: %w", m.cfg.Provider, e.Err))
		return
	}
	m.lastStatus = e.At
	var errs []error
	if e.Healthz != "ok" {
		errs = append(errs, fmt.Errorf("got unexpected healthz status: %s", e.Healthz))
	}
	switch {
	case e.Version != VersionV2 && e.Version != VersionV2beta1:
		errs = append(errs, fmt.Errorf("expected KMSv2 API version %s, got %s", VersionV2, e.Version))
	case m.version == "":
		m.version = e.Version
	case m.version != e.Version:
		errs = append(errs, fmt.Errorf("KMSv2 API version should not change after the initial status response version %s, got %s", m.version, e.Version))
	}
	if _, err := wire.ValidateKeyID(e.KeyID); err != nil {
		errs = append(errs, fmt.Errorf("got invalid KMSv2 KeyID hash %q: %w", KeyIDHash(e.KeyID), err))
	}
	if len(errs) > 0 {
		// Unhealthy: never extends the write expiry and never rotates (#138950).
		m.setHealth(e.At, fmt.Errorf("kmsv2 Provider %s is not healthy, error: %w", m.cfg.Provider, errors.Join(errs...)))
		return
	}
	m.lastHealthy = e.At
	if m.deferKeyID(e) {
		return
	}
	m.reported = e.KeyID
	if w := m.write; w != nil && (w.KeyID == e.KeyID || m.cfg.Fenced) {
		if w.KeyID == e.KeyID {
			m.held, m.heldSince, m.heldStatus = "", time.Time{}, time.Time{}
		} else {
			// Fenced: the current DEK source stays readable by every plugin (old key
			// ids remain decryptable), so it keeps writing, as long as the plugin is
			// healthy, until WriteAllowed names the new key id.
			if m.held != e.KeyID {
				m.held, m.heldSince = e.KeyID, e.At
			}
			m.heldStatus = e.At
		}
		nw := *w
		nw.Expiry = e.At.Add(m.cfg.WriteTTL)
		m.write = &nw
		m.setHealth(e.At, nil)
		m.maybeRefresh()
		return
	}
	// Key id changed, or no write state yet: rotate. Health is decided
	// by the rotation; the old write state keeps its expiry meanwhile.
	m.rotKeyID = e.KeyID
	m.rotStatus = e.At
	m.rotQueued = true
	m.rotReason = ""
	m.nextStatus = e.At.Add(m.cfg.StatusInterval)
}

// deferKeyID applies the key id rules to a healthy Status (see the package rules): it
// reports whether the Status's key id must not act yet (a reuse, or a candidate not
// yet confirmed), in which case it has extended the write state and decided health.
func (m *Machine) deferKeyID(e StatusResult) bool {
	w := m.write
	if w != nil && w.KeyID == e.KeyID {
		m.candidate, m.candidateSeen, m.candidateSince = "", 0, time.Time{}
		m.reused, m.reusedSince = "", time.Time{}
		return false
	}
	canWrite := w != nil && e.At.Before(w.Expiry)
	switch {
	case m.isSuperseded(e.KeyID):
		if m.reused != e.KeyID {
			m.reused, m.reusedSince = e.KeyID, e.At
			m.reuses++
		}
		m.candidate, m.candidateSeen, m.candidateSince = "", 0, time.Time{}
	case !canWrite || e.KeyID == m.held || m.cfg.KeyIDConfirmations <= 1:
		// Nothing to keep writing with, already confirmed (held by the fence), or no
		// confirmation asked for: the key id acts now.
		m.candidate, m.candidateSeen, m.candidateSince = "", 0, time.Time{}
		m.reused, m.reusedSince = "", time.Time{}
		return false
	default:
		m.reused, m.reusedSince = "", time.Time{}
		if m.candidate != e.KeyID {
			m.candidate, m.candidateSeen, m.candidateSince = e.KeyID, 0, e.At
		}
		m.candidateSeen++
		if m.candidateSeen >= m.cfg.KeyIDConfirmations {
			// Confirmed: the Encrypt it now asks for must answer with it too.
			m.candidate, m.candidateSeen, m.candidateSince = "", 0, time.Time{}
			return false
		}
	}
	// The current write state keeps writing while it can: the plugin answered healthy.
	if canWrite {
		nw := *w
		nw.Expiry = e.At.Add(m.cfg.WriteTTL)
		m.write = &nw
	}
	m.setHealth(e.At, nil)
	return true
}

// isSuperseded reports whether keyID was written with and then replaced by another key
// id: by this machine, or per the driver's Superseded.
func (m *Machine) isSuperseded(keyID string) bool {
	for _, k := range m.retired {
		if k == keyID {
			return true
		}
	}
	return m.superseded[KeyIDHash(keyID)]
}

// retire remembers keyID as superseded by this machine's rotation to next.
func (m *Machine) retire(keyID, next string) {
	kept := m.retired[:0]
	for _, k := range m.retired {
		if k != keyID && k != next {
			kept = append(kept, k)
		}
	}
	m.retired = append(kept, keyID)
	if len(m.retired) > maxRetired {
		m.retired = append([]string(nil), m.retired[len(m.retired)-maxRetired:]...)
	}
}

func (m *Machine) stepEncrypt(e EncryptResult) {
	if !m.encryptInFlight || e.Seq != m.seq {
		return // a result for an abandoned request
	}
	m.encryptInFlight = false
	reason := m.rotReason
	m.rotReason = ""
	if w := m.write; e.Err == nil && e.KeyID != m.rotKeyID && w != nil && m.rotStatus.Before(w.Expiry) {
		// A disagreement is reported, not followed: the write state that can still
		// write keeps writing, extended by the healthy Status that asked for the
		// rotation. A key id change asks for confirmation again.
		m.disagreements++
		m.disagreement = fmt.Sprintf("the Status answered key id hash %q but the Encrypt answered %q; writing under %q still",
			KeyIDHash(m.rotKeyID), KeyIDHash(e.KeyID), KeyIDHash(w.KeyID))
		nw := *w
		nw.Expiry = m.rotStatus.Add(m.cfg.WriteTTL)
		m.write = &nw
		m.setHealth(m.rotStatus, nil)
		m.healthAt = e.At
		return
	}
	if err := m.checkEncrypt(e); err != nil {
		if e.Err == nil && e.KeyID != m.rotKeyID {
			m.disagreements++
			m.disagreement = fmt.Sprintf("the Status answered key id hash %q but the Encrypt answered %q; no DEK source to write with",
				KeyIDHash(m.rotKeyID), KeyIDHash(e.KeyID))
		}
		w := "<none>"
		exp := "<none>"
		if m.write != nil {
			w = KeyIDHash(m.write.KeyID)
			exp = m.write.Expiry.UTC().Format(time.RFC3339)
		}
		m.setHealth(e.At, fmt.Errorf("kmsv2 Provider %s is not healthy, error: failed to rotate DEK source (type %s): %w; statusKeyIDHash=%q, encryptKeyIDHash=%q, stateKeyIDHash=%q, writes allowed until %s",
			m.cfg.Provider, m.cfg.WriteType, err, KeyIDHash(m.rotKeyID), KeyIDHash(e.KeyID), w, exp))
		return
	}
	if m.write == nil && m.cfg.Fenced && m.cfg.FirstSeedHold > 0 {
		m.firstHeldUntil = e.At.Add(m.cfg.FirstSeedHold)
	}
	if m.write != nil && m.write.KeyID != e.KeyID {
		m.retire(m.write.KeyID, e.KeyID)
	}
	m.generation++
	m.write = &WriteState{
		Generation:  m.generation,
		KeyID:       e.KeyID,
		Type:        m.cfg.WriteType,
		Ciphertext:  e.Ciphertext,
		Annotations: wire.SortedAnnotations(e.Annotations),
		Source:      e.Source,
		// Counted from the healthy Status, not from the Encrypt answer.
		Expiry:  m.rotStatus.Add(m.cfg.WriteTTL),
		Created: e.At,
		Refresh: reason,
	}
	m.seedWrites = 0
	m.setHealth(m.rotStatus, nil)
	m.healthAt = e.At
}

func (m *Machine) checkEncrypt(e EncryptResult) error {
	if e.Err != nil {
		return fmt.Errorf("failed to encrypt DEK, error: %w", e.Err)
	}
	if e.KeyID != m.rotKeyID {
		return errors.New("the Encrypt key id differs from the Status key id; the plugin must report the key it encrypts with")
	}
	if _, err := wire.ValidateKeyID(e.KeyID); err != nil {
		return fmt.Errorf("failed to validate key id: %w", err)
	}
	if err := wire.ValidateDEKSource(e.Ciphertext); err != nil {
		return fmt.Errorf("failed to validate encrypted DEK source: %w", err)
	}
	if err := wire.ValidateAnnotations(wire.SortedAnnotations(e.Annotations)); err != nil {
		return fmt.Errorf("failed to validate annotations: %w", err)
	}
	if len(e.Source) != 32 {
		return fmt.Errorf("the DEK source is %d bytes, want 32", len(e.Source))
	}
	return nil
}

// View returns the current outcome.
func (m *Machine) View() View {
	v := View{
		Now:         m.now,
		Write:       m.write,
		Healthy:     m.healthy,
		Err:         m.err,
		HealthAt:    m.healthAt,
		LastStatus:  m.lastStatus,
		LastHealthy: m.lastHealthy,
		NextWake:    m.nextStatus,
		Rotating:    m.encryptInFlight || m.rotQueued,
		Reported:    m.reported,
		Held:        m.held,
		HeldSince:   m.heldSince,
	}
	v.CanWrite = m.write != nil && m.now.Before(m.write.Expiry)
	if !m.firstHeldUntil.IsZero() {
		v.FirstSeedHeld, v.FirstSeedHeldUntil = true, m.firstHeldUntil
		if m.firstHeldUntil.Before(v.NextWake) {
			v.NextWake = m.firstHeldUntil
		}
	}
	v.FirstSeedHoldExpired = m.firstExpired
	v.SeedWrites = m.seedWrites
	v.RefreshDue = m.refreshDue()
	v.Candidate, v.CandidateSeen, v.CandidateSince = m.candidate, m.candidateSeen, m.candidateSince
	v.Reused, v.ReusedSince, v.Reuses = m.reused, m.reusedSince, m.reuses
	v.Disagreements, v.Disagreement = m.disagreements, m.disagreement
	// Wake for the age bound when it can be acted on then; a blocked refresh is looked
	// at again after the Status that unblocks it.
	if w := m.write; w != nil && m.cfg.SeedMaxAge > 0 {
		if due := w.Created.Add(m.cfg.SeedMaxAge); due.After(m.now) && due.Before(v.NextWake) {
			v.NextWake = due
		}
	}
	return v
}

// KeyIDHash is how key ids appear in errors, logs, metrics and status: "sha256:<hex>",
// or "" for an empty id.
func KeyIDHash(keyID string) string {
	if keyID == "" {
		return ""
	}
	return fmt.Sprintf("sha256:%x", sha256Sum(keyID))
}
