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
		f := NewFence("self", now)
		members := liveMembers{}
		unknown := map[string]UnknownMember{}
		var current []transformers.RuleInfo
		var self MemberState // this apiserver's state, for keyid-holds
		sync := func() {
			f.Step(MembersChanged{Members: members.list(), Unknown: slices.SortedFunc(maps.Values(unknown),
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
					unknown[id] = UnknownMember{Key: MemberKey(DefaultPrefix, id), APIServerID: id, Reason: strings.TrimSpace(d.Input)}
				}
				sync()
				return "ok"
			case "members-loaded":
				sync()
				return "ok"
			case "config":
				next := parseRules(t, d.Input)
				current = applyWriters(next, f.Writers(current, next))
				return renderFence(f, current, now)
			case "refence":
				current = applyWriters(current, f.Writers(current, current))
				return renderFence(f, current, now)
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
				f.Step(Tick{Now: now})
				return fmt.Sprintf("t=%s", now.Sub(epoch))
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

func renderFence(f *Fence, rules []transformers.RuleInfo, now time.Time) string {
	var b strings.Builder
	holds := map[string]Hold{}
	for _, h := range f.Holds() {
		holds[h.Resource] = h
	}
	sort.SliceStable(rules, func(i, j int) bool { return rules[i].Resource < rules[j].Resource })
	for _, r := range rules {
		fmt.Fprintf(&b, "%s: writes %s", r.Resource, r.ReadKeys[r.WriteIndex])
		if h, ok := holds[r.Resource]; ok {
			fmt.Fprintf(&b, "; holds %s for %s, waiting for %s", h.Held, ago(now, h.Since), strings.Join(h.WaitingFor, ","))
			if h.Unsafe {
				b.WriteString(" (unsafe: no key every member reads)")
			}
		}
		b.WriteString("\n")
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
