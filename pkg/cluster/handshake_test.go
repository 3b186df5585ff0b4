package cluster

import (
	"fmt"
	"maps"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestHandshakeTranscripts plays testdata/handshake*.txt: several apiservers, each
// with its fence, its handshake and its guard's checks, on a model of etcd that orders
// Puts by revision. Every step is one I/O of a Node, so a transcript is one
// interleaving.
//
//	start id=<id>            input: the member's configuration (parseRules); it
//	                         applies it (fence decides the writer)
//	config id=<id>           input: a new configuration without dropped keys (reload)
//	publish id=<id>          the member puts its record (with an announced drop)
//	watch id=<id>            its watch catches up: the fence sees every record
//	read id=<id>             a linearizable read of every record (the handshake)
//	refence id=<id>          the fence decides again (promotion)
//	drop id=<id>             input: a configuration that drops keys; the guard checks
//	                         it against the watched records and, if nothing writes a
//	                         dropped key, announces the drop (a publish)
//	recheck id=<id>          the guard reads every record and swaps or refuses
//	check                    every member's write keys against every member's
//	                         configuration: what a reader would fail on
func TestHandshakeTranscripts(t *testing.T) {
	runTranscripts(t, "handshake", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		w := &world{members: map[string]*simMember{}, records: map[string]MemberState{}}
		return func(t *testing.T, d *datadriven.TestData) string {
			if d.Cmd == "check" {
				return w.check()
			}
			if d.Cmd == "etcd" {
				return w.render()
			}
			var id string
			d.ScanArgs(t, "id", &id)
			m := w.members[id]
			if m == nil && d.Cmd != "start" {
				d.Fatalf(t, "no member %q", id)
			}
			switch d.Cmd {
			case "start":
				m = &simMember{id: id, fence: newFence(id, epoch), hs: newHandshake(id)}
				m.fence.SetPromotionGate(m.hs)
				w.members[id] = m
				m.fence.Step(membersChanged{Members: w.list()})
				return m.apply(parseRules(t, d.Input))
			case "config":
				// A later reload attempt concludes an announced drop (Node.announced).
				m.next, m.plan = nil, nil
				return m.apply(parseRules(t, d.Input))
			case "publish":
				return w.publish(m)
			case "watch":
				m.fence.Step(membersChanged{Members: w.list()})
				return "ok"
			case "read":
				m.hs.Read(membersRead{Members: w.list()})
				return fmt.Sprintf("read at rev %d", w.rev)
			case "refence":
				return m.apply(m.rules)
			case "drop":
				m.next = parseRules(t, d.Input)
				c := checkDrops(id, m.configured(), ruleState(m.next), append(m.fence.others(), m.state()))
				if len(c.InUse) > 0 {
					m.next, m.plan = nil, nil
					return "refused without announcing:\n" + strings.Join(c.Reasons(), "\n")
				}
				m.plan = c.Drops
				return "announced: " + w.publish(m)
			case "recheck":
				others := slices.DeleteFunc(w.list(), func(o MemberState) bool { return o.APIServerID == id })
				c := checkDrops(id, m.configured(), ruleState(m.next), append(others, m.state()))
				if len(c.InUse) > 0 {
					m.plan = nil
				}
				if c.Refused() {
					return fmt.Sprintf("read at rev %d; refused (announcement %s):\n%s", w.rev, map[bool]string{true: "kept", false: "withdrawn"}[m.plan != nil], strings.Join(c.Reasons(), "\n"))
				}
				next := m.next
				m.next, m.plan = nil, nil
				return fmt.Sprintf("read at rev %d; swapped\n", w.rev) + m.apply(next)
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

// world is etcd's member records as a transcript sees them.
type world struct {
	members map[string]*simMember
	records map[string]MemberState
	revs    map[string]int64
	rev     int64
}

func (w *world) list() []MemberState {
	var out []MemberState
	for _, id := range slices.Sorted(maps.Keys(w.records)) {
		out = append(out, w.records[id])
	}
	return out
}

func (w *world) publish(m *simMember) string {
	st := withoutKeys(m.state(), m.plan)
	w.rev++
	w.records[m.id] = st
	if w.revs == nil {
		w.revs = map[string]int64{}
	}
	w.revs[m.id] = w.rev
	m.hs.Published(st)
	return fmt.Sprintf("rev %d: %s", w.rev, renderRecord(st))
}

func (w *world) render() string {
	var b strings.Builder
	for _, st := range w.list() {
		fmt.Fprintf(&b, "rev %d: %s\n", w.revs[st.APIServerID], renderRecord(st))
	}
	return b.String()
}

// check lists every write key some member's configuration cannot read.
func (w *world) check() string {
	var bad []string
	for _, id := range slices.Sorted(maps.Keys(w.members)) {
		for _, r := range w.members[id].rules {
			if r.WriteRefused != "" {
				continue // writes nothing
			}
			k := r.ReadKeys[r.WriteIndex]
			for _, oid := range slices.Sorted(maps.Keys(w.members)) {
				if !w.members[oid].state().CanRead(r.Resource, k) {
					bad = append(bad, fmt.Sprintf("UNREADABLE: %s writes %s with %s, which %s cannot read", id, r.Resource, k, oid))
				}
			}
		}
	}
	if len(bad) == 0 {
		return "ok: every member reads every member's write keys"
	}
	return strings.Join(bad, "\n")
}

// simMember is one apiserver of a transcript.
type simMember struct {
	id    string
	fence *fence
	hs    *handshake
	rules []transformers.RuleInfo // serving now
	next  []transformers.RuleInfo // a drop being checked
	plan  map[string][]Key        // the drop announced
}

// apply serves next with the writers the fence chooses.
func (m *simMember) apply(next []transformers.RuleInfo) string {
	m.hs.BeginDecision()
	m.rules = applyWriters(next, m.fence.Decide(m.rules, next).Writers)
	var b strings.Builder
	for _, r := range m.rules {
		if r.WriteRefused != "" {
			fmt.Fprintf(&b, "%s: refuses writes", r.Resource)
		} else {
			fmt.Fprintf(&b, "%s: writes %s", r.Resource, r.ReadKeys[r.WriteIndex])
		}
		for _, h := range m.fence.Holds() {
			if h.Resource == r.Resource {
				fmt.Fprintf(&b, "; holds %s, waiting for %s", h.Held, strings.Join(h.WaitingFor, ","))
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// state is the member's record as its node computes it (without an announced drop).
func (m *simMember) state() MemberState {
	return stateFromStatus(m.id, "", reload.Status{Resources: m.rules}, m.fence.HeldSince(), time.Time{})
}

// configured is the member's configuration as configState describes it.
func (m *simMember) configured() MemberState { return ruleState(m.rules) }

// ruleState is configState for rules: every rule writes with its first entry.
func ruleState(rules []transformers.RuleInfo) MemberState {
	var st MemberState
	for _, r := range rules {
		r.WriteIndex = 0
		st.Resources = append(st.Resources, resourceState(r))
	}
	return st
}

func renderRecord(st MemberState) string {
	var parts []string
	for _, r := range st.Resources {
		var read []string
		for _, k := range r.Read {
			read = append(read, k.String())
		}
		s := fmt.Sprintf("%s %s writes %s reads %s", st.APIServerID, r.Resource, r.Write, strings.Join(read, ","))
		if r.Held != nil {
			s += " held " + r.Held.String()
		}
		parts = append(parts, s)
	}
	return strings.Join(parts, "; ")
}

// TestHandshakeConfirmsKeysNotNames: a read confirms the key a member's record shows
// held — provider, name, check value and, for KMS v2, key id hash — and the fence may
// promote that key only: not a same-named key with another secret, nor the same KMS
// provider under another key id. A record that shows another key under the name
// withdraws the confirmation.
func TestHandshakeConfirmsKeysNotNames(t *testing.T) {
	for _, tc := range []struct {
		name              string
		self, other       string
		confirmed, others Key
	}{
		{"local key, other secret",
			"secrets: aesgcm/k2, *aesgcm/k1", "secrets: aesgcm/k2, aesgcm/k1",
			parseKey("aesgcm/k2"), parseKey("aesgcm/k2#s2")},
		{"KMS v2, other key id",
			"secrets: kms/vault@h1, *aesgcm/k1\nplugin vault: writes=h1", "secrets: kms/vault@h1, aesgcm/k1\nplugin vault: writes=h1",
			parseKey("kms/vault@h1"), parseKey("kms/vault@h2")},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHandshake("a")
			self, other := parseMember(t, "a", tc.self, epoch), parseMember(t, "b", tc.other, epoch)
			h.Read(membersRead{Members: []MemberState{self, other}})
			if ok, _ := h.MayPromote("secrets", tc.confirmed); !ok {
				t.Fatalf("%s not confirmed by a read where every member reads it", tc.confirmed)
			}
			h.BeginDecision()
			if ok, why := h.MayPromote("secrets", tc.others); ok || why != waitingForConfirmation || !h.Pending() {
				t.Fatalf("%s (same name as the confirmed %s) may promote: %v %q, pending %v", tc.others, tc.confirmed, ok, why, h.Pending())
			}
			// This member's record now shows the other key as configured: the
			// confirmation of the first is withdrawn.
			self.Resources[0].Read[0], self.Resources[0].Held = tc.others, &tc.others
			h.Published(self)
			if ok, _ := h.MayPromote("secrets", tc.confirmed); ok {
				t.Fatalf("%s still confirmed after the record showed %s configured", tc.confirmed, tc.others)
			}
		})
	}
}
