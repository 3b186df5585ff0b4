package cluster

import (
	"fmt"
	"slices"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// The handshake between a configuration that drops keys (the guard) and a promotion
// (the fence), so that neither can miss the other. Each side first makes its intent
// visible in its own member record, then reads every member record with a linearizable
// read issued after that Put, and acts only if the read shows no conflict:
//
//   - the dropping side publishes the reduced readable set (its record with the keys it
//     is about to lose removed from every rule's read list and held key, withoutKeys),
//     then reads, then swaps unless some member has one of those keys configured as its
//     write key (written or held);
//   - the promoting side publishes the key as held (its record shows it as the
//     configured write key), then reads, then promotes only if every member of that read
//     can still read the key (handshake).
//
// etcd orders the two Puts by revision, and each side's read is at a revision after its
// own Put, so the side whose Put came second sees the other's in its read and backs off;
// both may back off, neither can miss the other (docs/cluster.md, "Guard and fence").
// These functions and handshake are pure; Node does the Puts and the reads.

// dropCheck is the guard's verdict on the keys a configuration drops, judged against
// member records.
type dropCheck struct {
	// Drops lists, by rule, the entries current reads and next does not.
	Drops map[string][]Key
	// InUse says which member writes a dropped key: refused without announcing the
	// drop (the drop cannot happen until that member's file changes).
	InUse []string
	// Configured says which member has a dropped key configured as its write key
	// without writing it yet (held back): refused, but the announcement stays up so that
	// member's fence never promotes onto it and a revert of every file converges.
	Configured []string
}

// Refused reports whether the drop must not happen now.
func (c dropCheck) Refused() bool { return len(c.InUse) > 0 || len(c.Configured) > 0 }

// Reasons are the refusal's words, written keys first.
func (c dropCheck) Reasons() []string { return append(slices.Clone(c.InUse), c.Configured...) }

// checkDrops compares the configuration serving now (current) with the one a reload
// would apply (next), both as configState describes them, against the members' records
// (self's own state included, as it serves now). A member other than self vetoes a
// drop with its write key and with its configured write key (Read[0], or Held): a held
// key is promoted the moment every member can read it. Self vetoes only with the key
// it writes: its own held key is exactly what a revert drops.
func checkDrops(self string, current, next MemberState, members []MemberState) dropCheck {
	c := dropCheck{Drops: map[string][]Key{}}
	for _, r := range current.Resources {
		for _, k := range r.Read {
			if next.CanRead(r.Resource, k) {
				continue
			}
			c.Drops[r.Resource] = append(c.Drops[r.Resource], k)
			for _, m := range members {
				rule, _ := m.Rule(r.Resource)
				w, writes := m.writes(r.Resource)
				switch {
				case writes && mayBeSame(w, k) && !ownUnreadWriteKey(m, members, self, r.Resource):
					c.InUse = append(c.InUse, fmt.Sprintf("%s: %s is the write key of apiserver %s", r.Resource, k, m.APIServerID))
				case m.APIServerID != self && mayBeSame(configuredWriteKey(rule), k):
					c.Configured = append(c.Configured, fmt.Sprintf("%s: %s is the configured write key of apiserver %s, held back until every apiserver can read it; "+
						"drop it from that apiserver's file too (or keep it here as a read key)", r.Resource, k, m.APIServerID))
				}
			}
		}
	}
	return c
}

// configuredWriteKey is the write key a member's configuration names for a rule, held
// back or not (Key{} when the rule reads nothing).
func configuredWriteKey(r ResourceState) Key {
	switch {
	case r.Held != nil:
		return *r.Held
	case len(r.Read) > 0:
		return r.Read[0]
	}
	return Key{}
}

// withoutKeys is st with drops (by rule) removed from each rule's read list and held
// key: the reduced readable set a member announces before it swaps to a configuration
// without them. Every other member's fence then counts it as unable to read them.
func withoutKeys(st MemberState, drops map[string][]Key) MemberState {
	if len(drops) == 0 {
		return st
	}
	st.Resources = slices.Clone(st.Resources)
	for i, r := range st.Resources {
		keys := drops[r.Resource]
		if len(keys) == 0 {
			continue
		}
		dropped := func(k Key) bool { return slices.ContainsFunc(keys, k.SameEntry) }
		r.Read = slices.DeleteFunc(slices.Clone(r.Read), dropped)
		if r.Held != nil && dropped(*r.Held) {
			r.Held, r.HeldSince = nil, time.Time{}
		}
		st.Resources[i] = r
	}
	return st
}

// membersRead is a linearizable read of every member record (Node reads the members
// prefix; etcd's default reads are linearizable): it reflects every Put that completed
// before it was issued, this member's own included.
type membersRead struct {
	Members []MemberState
}

// handshake is the promotion side of the handshake, a pure machine: the fence asks it
// (promotionGate) whether a configured write key that every member of its view can read
// may start writing. It may once a read issued after this member's record showed that
// key (the same key: name, check value, KMS key id hash) as configured found every
// other member able to read it; the record keeps showing
// the key until the promotion, so a member dropping it later reads it there and backs
// off. Not safe for concurrent use; the Node serialises access.
type handshake struct {
	self string
	// confirmed maps a rule to the key a read confirmed.
	confirmed map[string]Key
	// pending lists the rules the fence asked about and was refused since the last
	// BeginDecision: a read would let them promote.
	pending map[string]Key
}

// promotionGate lets the fence promote a key only when a second party agrees (Node:
// the handshake). resource is the rule, k its configured write key, which every live
// member of the fence's view can read.
type promotionGate interface {
	MayPromote(resource string, k Key) (ok bool, waitingFor string)
}

// waitingForConfirmation is what a hold the handshake keeps waits for.
const waitingForConfirmation = "(a read of every member after publishing the key as held)"

// newHandshake returns the handshake of apiserver self, with nothing confirmed.
func newHandshake(self string) *handshake {
	return &handshake{self: self, confirmed: map[string]Key{}, pending: map[string]Key{}}
}

// BeginDecision starts a round of the fence's questions.
func (h *handshake) BeginDecision() { clear(h.pending) }

// MayPromote is the promotionGate.
func (h *handshake) MayPromote(resource string, k Key) (bool, string) {
	if c, ok := h.confirmed[resource]; ok && sameConfirmedKey(c, k) {
		return true, ""
	}
	h.pending[resource] = k
	return false, waitingForConfirmation
}

// Pending reports whether the fence was refused a promotion that a read could allow.
func (h *handshake) Pending() bool { return len(h.pending) > 0 }

// Read feeds a linearizable read of the members. For each rule whose configured write
// key self's record in it shows, the key is confirmed when every other member of the
// read can read it; otherwise the rule's confirmation is withdrawn. Without its own
// record in the read (not published yet, or its lease ended) nothing is confirmed.
func (h *handshake) Read(r membersRead) {
	clear(h.confirmed)
	i := slices.IndexFunc(r.Members, func(m MemberState) bool { return m.APIServerID == h.self })
	if i < 0 {
		return
	}
	for _, rule := range r.Members[i].Resources {
		k := configuredWriteKey(rule)
		if k == (Key{}) {
			continue
		}
		everyone := true
		for _, m := range r.Members {
			if m.APIServerID != h.self && !m.CanRead(rule.Resource, k) {
				everyone = false
				break
			}
		}
		if everyone {
			h.confirmed[rule.Resource] = k
		}
	}
}

// Published tells the handshake what this member's record now says: a confirmation
// whose key the record no longer shows as configured is withdrawn (a later record
// showing it again needs a new read).
func (h *handshake) Published(st MemberState) {
	for res, k := range h.confirmed {
		i := slices.IndexFunc(st.Resources, func(r ResourceState) bool { return r.Resource == res })
		if i < 0 || !sameConfirmedKey(configuredWriteKey(st.Resources[i]), k) {
			delete(h.confirmed, res)
		}
	}
}

// sameConfirmedKey reports whether a confirmation of key c holds for key k: the same
// key, not merely the same name — provider, name and check value (KeyInfo.Match proves
// the secrets equal; a key without a check value is never confirmed), and for KMS the
// same key id hash. A same-named key with other material needs a read of its own.
func sameConfirmedKey(c, k Key) bool {
	return c.Match(k) == transformers.KeysSame && c.KeyIDHash == k.KeyIDHash
}

// RecordLost withdraws every confirmation: while this member had no record, a member
// dropping a key could have read the members without seeing it.
func (h *handshake) RecordLost() { clear(h.confirmed) }
