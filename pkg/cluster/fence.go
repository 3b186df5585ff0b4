package cluster

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// fence is the write fence of one apiserver, a pure state machine in etcd raft's shape:
// no I/O, no goroutines, time comes in through Step. It answers one question — which
// entry of each resource rule's chain may write now — so that the apiserver never
// starts writing with a key some live member cannot read.
//
// Rule: a rule writes with the configuration's first entry K once every live member
// (other than this one) can read K, and keeps writing with it once it does (a member
// that cannot read the key already written is a straggler, not a veto). Until then K is
// held: the rule keeps writing with
// the entry that wrote before, if the new chain still has it and everyone reads it;
// else with the first entry of the chain everyone reads. When no entry qualifies it
// writes with K anyway (nothing safer exists: the members that cannot read it are
// stragglers and fail /readyz) — unless the entry that wrote before is still in the
// chain: then it keeps writing, so a straggler never makes the others switch keys. The
// hold records both cases as unsafe. When the entry chosen would make this apiserver a
// straggler (stragglers: no other live member reads it, and it cannot read the write
// key of members that moved on), no entry writes: writes are refused with a reason
// naming the key it lacks, until its file catches up. Promotion is
// re-asking after the member set changed (reloadAgent.Refence).
//
// The fence is not safe for concurrent use; the Node serialises access.
type fence struct {
	self   string
	now    time.Time
	synced bool
	// live are the live members other than self, sorted by id once per member list
	// (memberList): every reload asks about each of them. members indexes them by id.
	live    []MemberState
	members map[string]int
	unknown []UnknownMember // records that are not members: they hold promotions
	holds   map[string]Hold // by resource
	// gate, when set, must also agree before a key is promoted (SetPromotionGate).
	gate promotionGate
	// The resynchronisation after a lost lease or a pause (fence_resync.go): ttl is the
	// member lease (0: pauses are not looked for), viewRev the revision of the latest
	// view, selfListed whether it shows this apiserver's record, losses how many losses
	// were stepped in, resync the hold of every write while one is not over (nil: none).
	ttl        time.Duration
	viewRev    int64
	selfListed bool
	losses     int
	resync     *resync
	// ready is what the steps changed since the driver last asked (Ready).
	ready fenceReady
}

// fenceReady is what the steps since the last Ready changed, for the driver to act on
// (raft's Ready: the machine says what happened, the driver does the I/O).
type fenceReady struct {
	// Lost is set when a loss began a resynchronisation (a lost lease, or a pause
	// longer than the lease TTL): the driver withdraws the handshake's confirmations,
	// applies the fence again so that every write is held, and publishes its record.
	Lost bool
	// Resynced is set when a resynchronisation ended; HeldSince is when it began. The
	// driver applies the fence again so that writes resume.
	Resynced  bool
	HeldSince time.Time
}

// Ready hands over what changed since the last call, and forgets it.
func (f *fence) Ready() fenceReady {
	r := f.ready
	f.ready = fenceReady{}
	return r
}

// Hold is a configured write key held back.
type Hold struct {
	Resource string `json:"resource"`
	// Held is the configured write key; Writing the entry writing instead.
	Held    Key `json:"held"`
	Writing Key `json:"writing"`
	// Since is when the fence started holding Held.
	Since time.Time `json:"since"`
	// WaitingFor lists the live members that cannot read Held yet.
	WaitingFor []string `json:"waitingFor"`
	// Unsafe is set when no entry of the chain is readable by every member, so Held
	// writes after all.
	Unsafe bool `json:"unsafe,omitempty"`
	// Refused is set, with why, when no entry writes: this apiserver straggles (its
	// write key is read by no other live member, and it cannot read theirs). Writing
	// is then zero.
	Refused string `json:"refused,omitempty"`
}

// fenceEvent is an input of fence.Step.
type fenceEvent interface{ fenceEvent() }

// membersChanged carries the live member set (it may include this apiserver; its own
// entry is ignored) and the unknown members (view.Unknown): while there is one, no new
// write key or KMS key id is promoted, since nobody knows what it can read.
// The machines may keep Members as it is: the sender must not change the list after
// stepping it.
type membersChanged struct {
	Members []MemberState
	Unknown []UnknownMember
	// Rev is the etcd revision the view is at (0: not known; the machines that do not
	// resynchronise ignore it).
	Rev int64
}

// tick advances the fence's clock.
type tick struct{ Now time.Time }

func (membersChanged) fenceEvent() {}
func (tick) fenceEvent()           {}

// newFence returns the fence of apiserver self. Until the first membersChanged it
// treats every other member as unknown and holds every new key.
func newFence(self string, now time.Time) *fence {
	return &fence{self: self, now: now, members: map[string]int{}, holds: map[string]Hold{}}
}

// SetPromotionGate makes every promotion also need g's agreement (Node: the handshake
// with members dropping keys). Without one the fence promotes on its view alone.
func (f *fence) SetPromotionGate(g promotionGate) { f.gate = g }

// Step feeds one event.
func (f *fence) Step(ev fenceEvent) {
	switch e := ev.(type) {
	case membersChanged:
		f.synced = true
		f.unknown = slices.Clone(e.Unknown)
		f.live = memberList(e.Members, f.self)
		f.members = make(map[string]int, len(f.live))
		for i, m := range f.live {
			f.members[m.APIServerID] = i
		}
		f.viewStepped(e)
	case tick:
		f.checkPause(e.Now)
		if e.Now.After(f.now) {
			f.now = e.Now
		}
	case leaseLost, recordPut:
		f.stepResync(e)
	}
}

// fenceDecision is what Decide hands back: the entry each rule writes with (the
// reload.Options.WriteFence contract) and how the holds changed, so that the driver
// logs and raises Events from the decision instead of comparing Holds before and after.
type fenceDecision struct {
	Writers map[string]transformers.Writer
	// Changed lists the holds that started or changed (another held key or writing
	// entry, refused or no longer, safe or no longer), sorted by resource.
	Changed []Hold
	// Released lists the holds that ended, sorted by resource: the held key writes
	// now (promoted), or the rule is gone.
	Released []Hold
	// Resyncing is set when every write is held to resynchronise (fence_resync.go).
	Resyncing bool
}

// Decide decides, for the rules of next (built from the configuration: ReadKeys[0] is
// the configured write key) given the rules serving now (current, nil at start), the
// entry each rule writes with, or that it refuses writes, and records the holds. It is
// an input like Step — the configuration the agent is about to serve — and hands back
// the decision.
func (f *fence) Decide(current, next []transformers.RuleInfo) fenceDecision {
	before := f.holds
	var out map[string]transformers.Writer
	if f.resync != nil {
		out = f.resyncWriters(next)
	} else {
		out = f.writers(current, next)
	}
	d := fenceDecision{Writers: out, Resyncing: f.resync != nil}
	for _, h := range f.Holds() {
		if b, ok := before[h.Resource]; !ok || !sameHold(b, h) {
			d.Changed = append(d.Changed, h)
		}
	}
	for _, r := range slices.Sorted(maps.Keys(before)) {
		if _, ok := f.holds[r]; !ok {
			d.Released = append(d.Released, before[r])
		}
	}
	return d
}

// sameHold reports whether two holds of one resource say the same thing (Since and
// WaitingFor may move without anything to report).
func sameHold(a, b Hold) bool {
	return a.Held == b.Held && a.Writing == b.Writing && a.Unsafe == b.Unsafe && a.Refused == b.Refused
}

// writers is Decide's rule outside a resynchronisation.
func (f *fence) writers(current, next []transformers.RuleInfo) map[string]transformers.Writer {
	out := map[string]transformers.Writer{}
	holds := map[string]Hold{}
	for _, n := range next {
		if len(n.ReadKeys) == 0 {
			continue
		}
		want := n.ReadKeys[0]
		idx, h := 0, Hold{Resource: n.Resource, Held: want, Since: f.now}
		// promotedElsewhere: want waits for the handshake although another live
		// member writes with it already (see below).
		promotedElsewhere := ""
		// Promotion needs every member's ack; keeping a promoted key does not. A
		// member that cannot read it now is a straggler (it rejoined with an old
		// file): it is not ready until its file catches up, and must not pull the
		// others back to an older key.
		if !writesAlready(current, n.Resource, want) {
			h.WaitingFor = append(f.cannotRead(n.Resource, want), f.unknownWaiting()...)
			if len(h.WaitingFor) == 0 && f.gate != nil {
				// Everyone reads want, but the handshake with a member dropping it has not
				// been done yet. Hold only when there is something else to write with: with
				// nothing else, want writes either way.
				if ok, why := f.gate.MayPromote(n.Resource, want); !ok {
					if i, _ := f.fallback(n, current); i != 0 {
						h.WaitingFor = []string{why}
						// When another live member writes with want already, writing the
						// older key meanwhile would store new data under a key the cluster
						// moved off (a straggler whose file caught up wrote key1 after the
						// migration to key2 had verified, and kept key1 in use); writing
						// want before the handshake could race a member dropping it on a
						// view newer than ours. Writes wait for the handshake instead (one
						// publish and one read).
						if f.othersWrite(n.Resource, want) {
							promotedElsewhere = why
						}
					}
				}
			}
		}
		if len(h.WaitingFor) > 0 {
			idx, h.Unsafe = f.fallback(n, current)
		}
		if promotedElsewhere != "" {
			why := fmt.Sprintf("writes of %s wait a moment: %s is written by other live apiservers already, and this apiserver is waiting for %s before it writes with it too",
				n.Resource, want, promotedElsewhere)
			out[n.Resource] = transformers.Writer{Refuse: why, RetryAfter: handshakeRetryAfter}
			h.Writing, h.Refused = Key{}, why
		} else if why := f.straggling(n, idx); why != "" {
			// Writing would store data that no other live apiserver can read.
			out[n.Resource] = transformers.Writer{Refuse: why}
			h.Writing, h.Refused = Key{}, why
		} else if why := f.downgrade(n, idx, current, h.WaitingFor); why != "" {
			// Holding a key back must never turn encryption off: wait for the cluster
			// instead, and tell clients to come back.
			out[n.Resource] = transformers.Writer{Refuse: why, RetryAfter: downgradeRetryAfter}
			h.Writing, h.Refused = Key{}, why
		} else if len(h.WaitingFor) == 0 {
			continue
		} else {
			h.Writing = n.ReadKeys[idx]
			if idx != 0 {
				out[n.Resource] = transformers.Writer{Index: idx}
			}
		}
		if old, ok := f.holds[n.Resource]; ok && old.Held.SameKey(want) {
			h.Since = old.Since
		}
		holds[n.Resource] = h
	}
	f.holds = holds
	return out
}

// straggling says why rule n must refuse writes when it would write with its entry idx
// ("" when it may write): this apiserver would straggle (see stragglers) — no other
// live member may read that entry, and it cannot read the write key of members that
// moved on. The reason names the keys it lacks.
func (f *fence) straggling(n transformers.RuleInfo, idx int) string {
	if !f.synced || len(f.members) == 0 {
		return ""
	}
	n.WriteIndex, n.WriteRefused = idx, ""
	self := MemberState{APIServerID: f.self, Resources: []ResourceState{resourceState(n)}}
	if !straggles(f.others(), self, n.Resource) {
		return ""
	}
	lacks := map[string][]string{}
	var keys []string
	for _, o := range f.others() {
		if w, ok := o.writes(n.Resource); ok && !self.mayRead(n.Resource, w) {
			if _, seen := lacks[w.String()]; !seen {
				keys = append(keys, w.String())
			}
			lacks[w.String()] = append(lacks[w.String()], o.APIServerID)
		}
	}
	var parts []string
	for _, k := range keys {
		parts = append(parts, fmt.Sprintf("%s (written by %s)", k, strings.Join(lacks[k], ",")))
	}
	return fmt.Sprintf("writes of %s are refused: this apiserver's encryption configuration cannot read %s, and no other live apiserver can read its write key %s; add the missing key to its configuration",
		n.Resource, strings.Join(parts, ", "), n.ReadKeys[idx])
}

// handshakeRetryAfter is the Retry-After of a write refused while a key other members
// already write with waits for this apiserver's handshake (a publish and a read).
const handshakeRetryAfter = time.Second

// downgradeRetryAfter is the Retry-After of a write refused rather than written in
// plaintext: the hold ends as soon as the cluster view shows the key readable.
const downgradeRetryAfter = 2 * time.Second

// downgrade says why rule n must refuse writes rather than write with its entry idx
// while the configured key is held for waiting ("" when it may write): a hold falls
// back only to a key the cluster was already writing with. identity is allowed only
// where plaintext was being written before — by this apiserver (a first-time
// encryption from [identity]) or by another live member; in a fresh cluster, or for a
// lone member whose own record is not visible yet, falling back to identity would write
// plaintext that nobody wrote before.
func (f *fence) downgrade(n transformers.RuleInfo, idx int, current []transformers.RuleInfo, waitingFor []string) string {
	if idx == 0 || n.ReadKeys[idx].Provider != transformers.ProviderIdentity || n.ReadKeys[0].Provider == transformers.ProviderIdentity {
		return ""
	}
	if writesAlready(current, n.Resource, n.ReadKeys[idx]) {
		return ""
	}
	for _, o := range f.others() {
		if w, ok := o.writes(n.Resource); ok && w.Provider == transformers.ProviderIdentity {
			return ""
		}
	}
	return fmt.Sprintf("writes of %s are refused for now: the write fence holds %s back (waiting for %s), and the only entry every apiserver reads is identity, which no apiserver of this cluster writes with; writing plaintext would turn encryption off. Writes resume once every apiserver can read %s",
		n.Resource, n.ReadKeys[0], strings.Join(waitingFor, ","), n.ReadKeys[0])
}

// writesAlready reports whether the rule for resource in current writes with k.
func writesAlready(current []transformers.RuleInfo, resource string, k Key) bool {
	for _, c := range current {
		if w, ok := c.Writer(); ok && c.Resource == resource && w.SameKey(k) {
			return true
		}
	}
	return false
}

// fallback picks the entry to write with while the configured one is held: the entry
// that wrote before if everyone reads it, else the first entry everyone reads; when no
// entry is read by everyone (a straggler reads none of them), the entry that wrote
// before if the chain still has it — a straggler never makes the others switch keys —
// else the configured one. The last two are unsafe.
func (f *fence) fallback(n transformers.RuleInfo, current []transformers.RuleInfo) (idx int, unsafe bool) {
	prev := -1
	for _, c := range current {
		w, ok := c.Writer()
		if c.Resource != n.Resource || !ok {
			continue
		}
		for i, k := range n.ReadKeys {
			if k.SameKey(w) {
				prev = i
				break
			}
		}
	}
	if prev >= 0 && len(f.cannotRead(n.Resource, n.ReadKeys[prev])) == 0 {
		return prev, false
	}
	for i, k := range n.ReadKeys[1:] {
		// KMS v1 only reads: an entry of it cannot stand in for the held key.
		if k.Provider != transformers.ProviderKMSv1 && len(f.cannotRead(n.Resource, k)) == 0 {
			return i + 1, false
		}
	}
	if prev >= 0 {
		return prev, true
	}
	return 0, true
}

// cannotRead lists the live members (sorted) that cannot read k for resource; before
// the first member list it is "unknown".
func (f *fence) cannotRead(resource string, k Key) []string {
	if !f.synced {
		return []string{"(member list not loaded)"}
	}
	var out []string
	for _, m := range f.others() {
		if !m.CanRead(resource, k) {
			out = append(out, m.APIServerID)
		}
	}
	return out
}

// othersWrite reports whether another live member writes resource with k.
func (f *fence) othersWrite(resource string, k Key) bool {
	for _, m := range f.others() {
		for _, r := range m.Resources {
			if r.Resource == resource && r.Write.SameKey(k) {
				return true
			}
		}
	}
	return false
}

// unknownWaiting names the unknown members a promotion waits for (they hold every
// promotion; the fallback entries ignore them, since they count for nobody's reads).
func (f *fence) unknownWaiting() []string {
	var out []string
	for _, u := range f.unknown {
		out = append(out, u.String())
	}
	return out
}

// The key-id fence. A KMS write key is a provider entry and the key id its plugin
// writes under. A provider whose plugin reports a new key id keeps writing under the
// old one until every other live member with a provider of that name reports, in its
// member state, that its plugin can decrypt the new one (MemberState.CanDecryptKeyID).
// Members without that provider are the entry fence's business: they cannot read the
// provider at all. These functions are the only statement of that rule; the fence, the
// status verdict and the migration leader ask them.

// keyIDUnknown reports a KMS entry whose plugin has not reported a key id yet: it names
// no key the members could agree on.
func keyIDUnknown(k Key) bool { return k.Provider == transformers.ProviderKMSv2 && k.KeyIDHash == "" }

// heldKeyID returns the key id r's KMS provider holds back while the same entry writes
// under an older one (ok false when r holds no key id).
func heldKeyID(r ResourceState) (held Key, ok bool) {
	if r.Held == nil || r.Held.Provider != transformers.ProviderKMSv2 || r.Held.KeyIDHash == "" || !r.Held.SameKey(r.Write) {
		return Key{}, false
	}
	return *r.Held, true
}

// keyIDWaitingFor lists, in the order of members, the members other than self whose
// plugin of KMS provider name is not known to decrypt keyIDHash.
func keyIDWaitingFor(members []MemberState, self, name, keyIDHash string) []string {
	waiting := []string{}
	for _, m := range members {
		if m.APIServerID == self {
			continue
		}
		if can, ok := m.CanDecryptKeyID(name, keyIDHash); ok && !can {
			waiting = append(waiting, m.APIServerID)
		}
	}
	return waiting
}

// MayWriteKeyID is the key-id fence's answer for this apiserver's KMS provider name: it
// may write under keyIDHash once no other live member's plugin is waiting for it.
// Before the first member list, and while writes are held to resynchronise, it stays
// closed.
func (f *fence) MayWriteKeyID(name, keyIDHash string) bool {
	return f.synced && f.resync == nil && len(f.unknown) == 0 && len(keyIDWaitingFor(f.others(), f.self, name, keyIDHash)) == 0
}

// KeyIDHolds describes the key ids self (this apiserver's state) holds back as Holds:
// Held is the held key id, Writing the same entry under the key id it writes with, and
// WaitingFor names the other live members whose plugin does not report Held yet.
func (f *fence) KeyIDHolds(self MemberState) []Hold {
	var holds []Hold
	for _, r := range self.Resources {
		held, ok := heldKeyID(r)
		if !ok {
			continue
		}
		holds = append(holds, Hold{Resource: r.Resource, Held: held, Writing: r.Write, Since: r.HeldSince,
			WaitingFor: append(keyIDWaitingFor(f.others(), f.self, held.Key, held.KeyIDHash), f.unknownWaiting()...)})
	}
	return holds
}

// others lists the live members other than this apiserver, sorted by id. The slice is
// the fence's own: read it, never change it.
func (f *fence) others() []MemberState { return slices.Clip(f.live) }

// Holds lists the keys held back now, by resource.
func (f *fence) Holds() []Hold {
	out := slices.Collect(maps.Values(f.holds))
	slices.SortFunc(out, func(a, b Hold) int {
		if a.Resource < b.Resource {
			return -1
		}
		if a.Resource > b.Resource {
			return 1
		}
		return 0
	})
	return out
}

// HeldSince maps each held resource to when its hold started (for MemberState).
func (f *fence) HeldSince() map[string]time.Time {
	out := map[string]time.Time{}
	for r, h := range f.holds {
		out[r] = h.Since
	}
	return out
}

// LongestHold is how long the oldest hold has lasted at the fence's clock.
func (f *fence) LongestHold() time.Duration {
	var d time.Duration
	for _, h := range f.holds {
		d = max(d, f.now.Sub(h.Since))
	}
	return d
}
