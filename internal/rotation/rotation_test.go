package rotation

import (
	"fmt"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
)

var epoch = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts steps the machine through testdata/stages/*.txt. Every command prints Ready.
//
//	start [timeout=<d>] [reset] [remove-identity] [resume-only] [grace=<d>] [manual-inventory]
//	                                     a new machine that sees the cluster as it is
//	                                     (reset: no members, no migration state, nothing
//	                                     stored; remove-identity: Config.RemoveIdentity;
//	                                     grace: Config.MigratorGrace; resume-only:
//	                                     Config.ResumeOnly; manual-inventory:
//	                                     take-inventory is printed and answered by the
//	                                     inventoried command, not at once)
//	file hash=<h> [rotates=<res>,…]      input: "<resources>: <key>, <key>…" per rule (first
//	                                     writes); rotates: FileRead.Rotates (default: every
//	                                     resource of the rules)
//	member id=<id> hash=<h> [gone] [error=<text>|retention-refused] [migrates=<res>,…|none]
//	                                     input: "<resource>: <key>, …" with * on the writing
//	                                     entry (a * not on the first entry: the first is held);
//	                                     without migrates the record does not say (older);
//	                                     retention-refused: the error is the backup-retention
//	                                     guard's refusal of aesgcm/k1, as an apiserver publishes it
//	stored                               input: "<resource> objects=<n> stale=<n> plaintext=<n>";
//	                                     what the next inventory counts (default: nothing)
//	inventoried / inventory-failed reason=<text>
//	migration                            input: none | record <res> <key> verified|error=<text> |
//	                                     running <res> <key> <done>/<total> | plan <res> <state>
//	first-edit-written / remove-written / edit-skipped
//	remove-refused reason=<text> [guard=<check>] [until=<d>]
//	                                     until: the guard holds the key for d from now
//	tick <duration>
//
// Keys are "aesgcm/k1", "kms/vault@h1" (key id hash h1) or "identity".
func TestTranscripts(t *testing.T) {
	datadriven.Walk(t, filepath.Join("testdata", "stages"), func(t *testing.T, path string) {
		var m *Machine
		now := epoch
		members := map[string]cluster.MemberState{}
		var mig *cluster.MigrationState
		var stored []StoredCount
		manual := false
		// ready answers take-inventory with the stored counts, unless manual.
		ready := func() Ready {
			r := m.Ready()
			if r.Action != ActionTakeInventory || manual {
				return r
			}
			m.Step(Inventoried{Resources: slices.Clone(stored)})
			next := m.Ready()
			next.Lines = append(r.Lines, next.Lines...)
			return next
		}
		observe := func() {
			var list []cluster.MemberState
			for _, mem := range members {
				list = append(list, mem)
			}
			slices.SortFunc(list, func(a, b cluster.MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
			m.Step(ClusterObserved{Members: list, Migration: mig, Prefix: "/rekey"})
		}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			if m == nil && d.Cmd != "start" {
				d.Fatalf(t, "start first")
			}
			switch d.Cmd {
			case "start":
				cfg := Config{GuardRetry: 5 * time.Second}
				if d.HasArg("timeout") {
					var s string
					d.ScanArgs(t, "timeout", &s)
					cfg.Timeout = mustDuration(t, d, s)
				}
				if d.HasArg("reset") {
					members, mig, stored = map[string]cluster.MemberState{}, nil, nil
				}
				cfg.RemoveIdentity = d.HasArg("remove-identity")
				cfg.ResumeOnly = d.HasArg("resume-only")
				manual = d.HasArg("manual-inventory")
				if d.HasArg("grace") {
					var s string
					d.ScanArgs(t, "grace", &s)
					cfg.MigratorGrace = mustDuration(t, d, s)
				}
				m = New(cfg, now)
				observe()
			case "file":
				var hash string
				d.ScanArgs(t, "hash", &hash)
				var rules []Rule
				for _, line := range lines(d.Input) {
					res, keys, ok := strings.Cut(line, ":")
					if !ok {
						d.Fatalf(t, "rule line %q: want <resources>: <keys>", line)
					}
					r := Rule{Resources: strings.Split(strings.TrimSpace(res), ",")}
					r.Stored = NamedResources(r.Resources)
					for _, k := range strings.Split(keys, ",") {
						r.Entries = append(r.Entries, parseKey(k))
					}
					rules = append(rules, r)
				}
				fr := FileRead{Hash: hash, Rules: rules, Rotates: storedOf(rules)}
				if d.HasArg("rotates") {
					var list string
					d.ScanArgs(t, "rotates", &list)
					fr.Rotates = strings.Split(list, ",")
				}
				m.Step(fr)
			case "member":
				var id string
				d.ScanArgs(t, "id", &id)
				if d.HasArg("gone") {
					delete(members, id)
				} else {
					mem := cluster.MemberState{APIServerID: id}
					d.ScanArgs(t, "hash", &mem.ConfigHash)
					if d.HasArg("error") {
						d.ScanArgs(t, "error", &mem.LastReloadError)
					}
					if d.HasArg("retention-refused") {
						mem.LastReloadError = "new configuration refused: " + retentionRefusal(now).Error()
					}
					if d.HasArg("migrates") {
						var list string
						d.ScanArgs(t, "migrates", &list)
						mem.StorageMigration = &cluster.StorageMigrationState{}
						if list != "none" {
							mem.StorageMigration.Resources = strings.Split(list, ",")
						}
					}
					for _, line := range lines(d.Input) {
						res, keys, _ := strings.Cut(line, ":")
						rs := cluster.ResourceState{Resource: strings.TrimSpace(res)}
						w := 0
						for i, k := range strings.Split(keys, ",") {
							k = strings.TrimSpace(k)
							if strings.HasPrefix(k, "*") {
								w, k = i, k[1:]
							}
							rs.Read = append(rs.Read, parseKey(k))
						}
						rs.Write = rs.Read[w]
						if w > 0 {
							h := rs.Read[0]
							rs.Held = &h
						}
						mem.Resources = append(mem.Resources, rs)
					}
					members[id] = mem
				}
				observe()
			case "migration":
				mig = &cluster.MigrationState{Records: map[string]cluster.Record{}}
				for _, line := range lines(d.Input) {
					f := strings.Fields(line)
					switch {
					case f[0] == "none":
						mig = nil
					case f[0] == "record" && len(f) == 4:
						rec := cluster.Record{Target: parseKey(f[2]), Verified: f[3] == "verified"}
						if !rec.Verified {
							rec.Error = strings.TrimPrefix(f[3], "error=")
						}
						mig.Records[f[1]] = rec
					case f[0] == "running" && len(f) == 4:
						done, total, _ := strings.Cut(f[3], "/")
						mig.Running = &cluster.Migration{Resource: f[1], Target: parseKey(f[2])}
						mig.Progress = &cluster.Progress{Resource: f[1], Done: atoi(t, d, done), Total: atoi(t, d, total)}
					case f[0] == "plan" && len(f) >= 3:
						mig.Plans = append(mig.Plans, cluster.Plan{Resource: f[1], State: f[2], Detail: strings.Join(f[3:], " ")})
					default:
						d.Fatalf(t, "migration line %q", line)
					}
				}
				observe()
			case "stored":
				stored = nil
				for _, line := range lines(d.Input) {
					f := strings.Fields(line)
					c := StoredCount{Resource: f[0]}
					for _, kv := range f[1:] {
						k, v, _ := strings.Cut(kv, "=")
						n := atoi(t, d, v)
						switch k {
						case "objects":
							c.Objects = n
						case "stale":
							c.Stale = n
						case "plaintext":
							c.Plaintext = n
						default:
							d.Fatalf(t, "stored line %q", line)
						}
					}
					stored = append(stored, c)
				}
			case "inventoried":
				m.Step(Inventoried{Resources: slices.Clone(stored)})
			case "inventory-failed":
				var reason string
				d.ScanArgs(t, "reason", &reason)
				m.Step(InventoryFailed{Reason: reason})
			case "first-edit-written":
				m.Step(FirstEditWritten{})
			case "remove-written":
				m.Step(RemoveWritten{})
			case "remove-refused":
				var reason string
				d.ScanArgs(t, "reason", &reason)
				ev := RemoveRefused{Reason: reason}
				if d.HasArg("guard") {
					var g string
					d.ScanArgs(t, "guard", &g)
					ev.Guard = guard.Check(g)
				}
				if d.HasArg("until") {
					var u string
					d.ScanArgs(t, "until", &u)
					ev.Until = now.Add(mustDuration(t, d, u))
				}
				m.Step(ev)
			case "edit-skipped":
				m.Step(EditSkipped{})
			case "tick":
				if len(d.CmdArgs) != 1 {
					d.Fatalf(t, "tick: want one duration")
				}
				now = now.Add(mustDuration(t, d, d.CmdArgs[0].Key))
				m.Step(Tick{Now: now})
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
			}
			return render(ready())
		})
	})
}

// retentionRefusal is the backup-retention guard's refusal of a file without aesgcm/k1,
// retired an hour before now, under a 30-day retention.
func retentionRefusal(now time.Time) *guard.RefusedError {
	retired := keyledger.Event{At: now.Add(-time.Hour), Revision: 40}
	k1 := keyledger.Entry{Provider: "aesgcm", Name: "k1", Check: "s1", LastUse: keyledger.Event{At: now.Add(-2 * time.Hour), Revision: 30}, Retired: &retired}
	return &guard.RefusedError{Check: guard.Retention, Next: `"enc.yaml" (h3)`, Holds: []guard.RetentionHold{
		{Key: k1, Until: retired.At.Add(720 * time.Hour), NeededFor: time.Hour, Retention: 720 * time.Hour}}}
}

func render(r Ready) string {
	var b strings.Builder
	for _, l := range r.Lines {
		fmt.Fprintf(&b, "> %s\n", l)
	}
	fmt.Fprintf(&b, "%s", r.Action)
	if len(r.Remove) > 0 {
		fmt.Fprintf(&b, " %s", strings.Join(r.Remove, ","))
	}
	fmt.Fprintf(&b, " | stage %s", r.Stage)
	if n := r.Stage.Number(); n >= 1 && n <= Stages {
		fmt.Fprintf(&b, " %d/%d", n, Stages)
	}
	if p := r.Progress; p.Members > 0 {
		fmt.Fprintf(&b, " | acked %d/%d", p.Acked, p.Members)
	}
	if p := r.Progress; p.Total > 0 {
		fmt.Fprintf(&b, " | objects %d/%d", p.Done, p.Total)
	}
	b.WriteString("\n")
	if r.Waiting != "" && r.Action == ActionWait {
		fmt.Fprintf(&b, "waiting: %s\n", r.Waiting)
	}
	if r.Err != "" {
		fmt.Fprintf(&b, "error: %s\n", r.Err)
	}
	return b.String()
}

func lines(s string) []string {
	var out []string
	for _, l := range strings.Split(strings.TrimSpace(s), "\n") {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	return out
}

func parseKey(s string) Key {
	s, hash, _ := strings.Cut(strings.TrimSpace(s), "@")
	p, k, _ := strings.Cut(s, "/")
	key := Key{Provider: p, Key: k, KeyIDHash: hash}
	if p == "aesgcm" || p == "aescbc" || p == "secretbox" {
		key.Check = "s1" // one secret per name, as the files the apiservers publish
	}
	return key
}

func mustDuration(t *testing.T, d *datadriven.TestData, s string) time.Duration {
	v, err := time.ParseDuration(s)
	if err != nil {
		d.Fatalf(t, "%v", err)
	}
	return v
}

func atoi(t *testing.T, d *datadriven.TestData, s string) int64 {
	v, err := strconv.ParseInt(s, 10, 64)
	if err != nil {
		d.Fatalf(t, "%v", err)
	}
	return v
}
