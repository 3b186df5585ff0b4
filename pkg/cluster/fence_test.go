package cluster

import (
	"fmt"
	"maps"
	"slices"
	"sort"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestFenceTranscripts steps the write fence through the stories in testdata/fence*.txt.
//
//	member id=<id> [gone]   input: the member's rules ("secrets: *aesgcm/k1,aesgcm/k2")
//	                        and KMS plugins (parseMember)
//	members-loaded          the first (empty) member list arrived
//	unknown id=<id> [gone]  input: why the record under <id>'s key is an unknown member
//	config                  input: this apiserver's new configuration (a reload)
//	refence                 ask again with the current rules (promotion)
//	may-write-keyid provider=<name> hash=<hash>
//	                        the key-id fence's answer for this apiserver's provider
//	keyid-holds             the key ids this apiserver holds back and whom they wait
//	                        for; input (kept until the next): its state (parseMember)
//	tick <duration>         advance the clock
func TestFenceTranscripts(t *testing.T) {
	runTranscripts(t, "fence", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		now := epoch
		f := newFence("self", now)
		members := liveMembers{}
		unknown := map[string]UnknownMember{}
		var current []transformers.RuleInfo
		var self MemberState // this apiserver's state, for keyid-holds
		sync := func() {
			f.Step(membersChanged{Members: members.list(), Unknown: slices.SortedFunc(maps.Values(unknown),
				func(a, b UnknownMember) int { return strings.Compare(a.Key, b.Key) })})
		}
		return func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "member":
				members.step(t, d, now)
				sync()
				return "ok"
			case "unknown":
				var id string
				d.ScanArgs(t, "id", &id)
				if d.HasArg("gone") {
					delete(unknown, id)
				} else {
					unknown[id] = UnknownMember{Key: memberKey(defaultPrefix, id), APIServerID: id, Reason: strings.TrimSpace(d.Input)}
				}
				sync()
				return "ok"
			case "members-loaded":
				sync()
				return "ok"
			case "config":
				next := parseRules(t, d.Input)
				dec := f.Decide(current, next)
				current = applyWriters(next, dec.Writers)
				return renderFence(f, current, now) + renderChanges(dec)
			case "refence":
				dec := f.Decide(current, current)
				current = applyWriters(current, dec.Writers)
				return renderFence(f, current, now) + renderChanges(dec)
			case "may-write-keyid":
				var provider, hash string
				d.ScanArgs(t, "provider", &provider)
				d.ScanArgs(t, "hash", &hash)
				if f.MayWriteKeyID(provider, hash) {
					return "open"
				}
				return "closed"
			case "keyid-holds":
				if d.Input != "" {
					self = parseMember(t, "self", d.Input, now)
				}
				return renderHolds(f.KeyIDHolds(self), now)
			case "tick":
				now = now.Add(durationArg(t, d))
				f.Step(tick{Now: now})
				return fmt.Sprintf("t=%s", now.Sub(epoch))
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

func renderFence(f *fence, rules []transformers.RuleInfo, now time.Time) string {
	var b strings.Builder
	holds := map[string]Hold{}
	for _, h := range f.Holds() {
		holds[h.Resource] = h
	}
	sort.SliceStable(rules, func(i, j int) bool { return rules[i].Resource < rules[j].Resource })
	for _, r := range rules {
		if w, ok := r.Writer(); ok {
			fmt.Fprintf(&b, "%s: writes %s", r.Resource, w)
		} else {
			fmt.Fprintf(&b, "%s: REFUSES WRITES: %s", r.Resource, r.WriteRefused)
		}
		if h, ok := holds[r.Resource]; ok && h.Refused == "" {
			fmt.Fprintf(&b, "; holds %s for %s, waiting for %s", h.Held, ago(now, h.Since), strings.Join(h.WaitingFor, ","))
			if h.Unsafe {
				b.WriteString(" (unsafe: no key every member reads)")
			}
		}
		b.WriteString("\n")
	}
	return b.String()
}

// renderChanges shows what a decision hands the driver to log: the holds that started
// or changed, and the ones that ended.
func renderChanges(d fenceDecision) string {
	var b strings.Builder
	for _, h := range d.Changed {
		switch {
		case h.Refused != "":
			fmt.Fprintf(&b, "> %s: refusing writes\n", h.Resource)
		case h.Unsafe:
			fmt.Fprintf(&b, "> %s: holding %s, writing %s, unsafe\n", h.Resource, h.Held, h.Writing)
		default:
			fmt.Fprintf(&b, "> %s: holding %s, writing %s\n", h.Resource, h.Held, h.Writing)
		}
	}
	for _, h := range d.Released {
		fmt.Fprintf(&b, "> %s: released %s\n", h.Resource, h.Held)
	}
	return b.String()
}

func renderHolds(holds []Hold, now time.Time) string {
	if len(holds) == 0 {
		return "no key id held"
	}
	var b strings.Builder
	for _, h := range holds {
		waiting := strings.Join(h.WaitingFor, ",")
		if waiting == "" {
			waiting = "nobody (the provider writes it at its next fence check)"
		}
		fmt.Fprintf(&b, "%s: writes %s; holds %s for %s, waiting for %s\n", h.Resource, h.Writing, h.Held, ago(now, h.Since), waiting)
	}
	return b.String()
}

// TestFenceHoldsUntilEveryMemberReads is the shortest story of the write fence: a new
// write key is held back, the previous one writing, until every other live member can
// read it.
func TestFenceHoldsUntilEveryMemberReads(t *testing.T) {
	k1 := Key{Provider: transformers.ProviderAESGCM, Key: "k1", Check: "5be0d8f8a1c7e2b3"}
	k2 := Key{Provider: transformers.ProviderAESGCM, Key: "k2", Check: "09e4c6d1f2a37b58"}
	b := MemberState{APIServerID: "b", Resources: []ResourceState{{Resource: "secrets", Write: k1, Read: []Key{k1}}}}

	f := newFence("a", epoch)
	f.Step(membersChanged{Members: []MemberState{b}})
	current := []transformers.RuleInfo{{Resource: "secrets", ReadKeys: []Key{k1}}}
	next := []transformers.RuleInfo{{Resource: "secrets", ReadKeys: []Key{k2, k1}}}
	if got := fmt.Sprint(f.Decide(current, next).Writers, f.Holds()[0].WaitingFor); got != "map[secrets:{1  0s}] [b]" {
		t.Errorf("b reads k1 only: writers and waiting = %s, want map[secrets:{1  0s}] [b] (k1 keeps writing, k2 waits for b)", got)
	}

	b.Resources[0].Read = []Key{k1, k2}
	f.Step(membersChanged{Members: []MemberState{b}})
	if got := fmt.Sprint(f.Decide(current, next).Writers, len(f.Holds())); got != "map[] 0" {
		t.Errorf("b reads k2 too: writers and holds = %s, want map[] 0 (k2 promoted)", got)
	}
}
