package cluster

import (
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/migrate"
)

// TestLeaderTranscripts steps the migration leader through testdata/leader*.txt.
//
//	leading / not-leading
//	member id=<id> [gone]          input: the member's rules, as in the fence transcripts
//	inventory resource=<r> [rev=<n>] [at=<duration>]
//	                               input: "<key>: <objects>" lines, read at etcd revision
//	                               n (default: the next one) and taken at this member's
//	                               clock plus at (default: now)
//	records                        input: "<r>: <key> verified|failed finished=<duration>
//	                               [rev=<n>]" lines: the records a new leader reads from
//	                               etcd (finished is the writer's clock, offset from epoch)
//	ready                          what the leader would start now (Ready; nothing changes)
//	started                        the driver started what ready said (migrationStarted)
//	next                           ready, then started
//	finished resource=<r> [error=<text>]   the record gets the next etcd revision
//	tick <duration>
//	plans                          every resource's plan
func TestLeaderTranscripts(t *testing.T) {
	runTranscripts(t, "leader", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		now := epoch
		l := newLeader([]string{"secrets", "configmaps"}, now)
		members := liveMembers{}
		var ready Migration // what the latest ready or next said
		var rev int64       // etcd's revision: every inventory and finished migration reads a newer one
		return func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "leading", "not-leading":
				l.Step(leadership{Leading: d.Cmd == "leading"})
				return renderPlans(l)
			case "member":
				members.step(t, d, now)
				l.Step(membersChanged{Members: members.list()})
				return "ok"
			case "inventory":
				var res string
				d.ScanArgs(t, "resource", &res)
				rev++
				at := rev
				if d.HasArg("rev") {
					// An explicit revision never moves etcd's own back.
					d.ScanArgs(t, "rev", &at)
					rev = max(rev, at)
				}
				ev := inventoryTaken{Resource: res, Revision: at, TakenAt: now}
				if d.HasArg("at") {
					ev.TakenAt = now.Add(durationArgNamed(t, d, "at"))
				}
				for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
					k, n, _ := strings.Cut(line, ":")
					c, err := strconv.ParseInt(strings.TrimSpace(n), 10, 64)
					if err != nil {
						d.Fatalf(t, "inventory line %q: %v", line, err)
					}
					ev.Objects = append(ev.Objects, keyCount{Key: parseKey(k), Objects: c})
				}
				l.Step(ev)
				return "ok"
			case "records":
				recs := map[string]Record{}
				for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
					res, rest, _ := strings.Cut(line, ":")
					f := strings.Fields(rest)
					if len(f) < 3 {
						d.Fatalf(t, "records line %q: want <r>: <key> verified|failed finished=<d> [rev=<n>]", line)
					}
					rec := Record{Target: parseKey(f[0]), Verified: f[1] == "verified"}
					for _, kv := range f[2:] {
						k, v, _ := strings.Cut(kv, "=")
						switch k {
						case "finished":
							dur, err := time.ParseDuration(v)
							if err != nil {
								d.Fatalf(t, "records line %q: %v", line, err)
							}
							rec.FinishedAt = epoch.Add(dur)
						case "rev":
							n, err := strconv.ParseInt(v, 10, 64)
							if err != nil {
								d.Fatalf(t, "records line %q: %v", line, err)
							}
							rec.Revision = n
							rev = max(rev, n)
						}
					}
					recs[strings.TrimSpace(res)] = rec
				}
				l.Step(recordsLoaded{Records: recs})
				return renderPlans(l)
			case "ready", "next":
				m, ok := l.Ready()
				if !ok {
					return "nothing\n" + renderPlans(l)
				}
				if d.Cmd == "next" {
					l.Step(migrationStarted{Migration: m})
				}
				ready = m
				return fmt.Sprintf("migrate %s to %s", m.Resource, m.Target)
			case "started":
				l.Step(migrationStarted{Migration: ready})
				return renderPlans(l)
			case "finished":
				var res, errText string
				d.ScanArgs(t, "resource", &res)
				if d.HasArg("error") {
					d.ScanArgs(t, "error", &errText)
				}
				m, _ := l.Running()
				rev++
				l.Step(migrationFinished{Resource: res, Target: m.Target, Err: errText, Revision: rev})
				rec := l.Records()[res]
				return fmt.Sprintf("record %s: target %s verified=%v", res, rec.Target, rec.Verified)
			case "tick":
				now = now.Add(durationArg(t, d))
				l.Step(tick{Now: now})
				return fmt.Sprintf("t=%s", now.Sub(epoch))
			case "plans":
				return renderPlans(l)
			case "recorded":
				var b strings.Builder
				recs := l.Records()
				for _, r := range slices.Sorted(maps.Keys(recs)) {
					rec := recs[r]
					fmt.Fprintf(&b, "record %s: target %s verified=%v rev=%d\n", r, rec.Target, rec.Verified, rec.Revision)
				}
				if b.Len() == 0 {
					return "no records"
				}
				return b.String()
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

func renderPlans(l *leader) string {
	var b strings.Builder
	for _, p := range l.Plans() {
		fmt.Fprintf(&b, "%s: %s", p.Resource, p.State)
		if p.Target != (Key{}) {
			fmt.Fprintf(&b, " %s", p.Target)
		}
		if p.Detail != "" {
			fmt.Fprintf(&b, " (%s)", p.Detail)
		}
		b.WriteString("\n")
	}
	return b.String()
}

// durationArgNamed is the duration argument name=<duration>.
func durationArgNamed(t *testing.T, d *datadriven.TestData, name string) time.Duration {
	t.Helper()
	var s string
	d.ScanArgs(t, name, &s)
	v, err := time.ParseDuration(s)
	if err != nil {
		d.Fatalf(t, "%s: %s: %v", d.Cmd, name, err)
	}
	return v
}

// TestInventoryEventsLeaveAcknowledgedObjectsOut: acknowledged unreadable objects stay
// where they are, so they never count as objects off the target, and the event carries
// the inventory's etcd revision.
func TestInventoryEventsLeaveAcknowledgedObjectsOut(t *testing.T) {
	inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 42, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k2"}, Objects: 10},
		{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k1"}, Objects: 1, Unreadable: 1, Acknowledged: 1},
		{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "k0"}, Objects: 3, Unreadable: 2, Acknowledged: 1},
	}}}}
	evs := inventoryEvents(inv)
	if len(evs) != 1 {
		t.Fatalf("events = %v", evs)
	}
	ev := evs[0].(inventoryTaken)
	if ev.Revision != 42 {
		t.Fatalf("revision = %d, want 42", ev.Revision)
	}
	if n := offTarget(ev, Key{Provider: "aesgcm", Key: "k2"}); n != 2 {
		t.Fatalf("off target = %d, want the 2 objects under k0 that are not acknowledged", n)
	}
}

// TestKnownRateComesFromTheLatestRecord: a finished migration's sustained rate is kept
// in its record (published in the migration state, read by the next leader), and the
// next migration starts from the latest record that has one; a migration that never
// had its clients judged (0) does not erase it.
func TestKnownRateComesFromTheLatestRecord(t *testing.T) {
	now := epoch
	l := newLeader([]string{"secrets", "configmaps"}, now)
	finish := func(res string, rate float64) {
		now = now.Add(time.Minute)
		l.Step(tick{Now: now})
		l.Step(migrationStarted{Migration: Migration{Resource: res, Target: Key{Provider: "aesgcm", Key: "k2"}, StartedAt: now}})
		l.Step(migrationFinished{Resource: res, Target: Key{Provider: "aesgcm", Key: "k2"}, SustainedRate: rate})
	}
	if got := knownRate(l.Records()); got != 0 {
		t.Fatalf("known rate with no records = %v, want 0", got)
	}
	finish("secrets", 900)
	finish("configmaps", 1400)
	if got := knownRate(l.Records()); got != 1400 {
		t.Fatalf("known rate = %v, want the latest record's 1400", got)
	}
	finish("configmaps", 0)
	if got := knownRate(l.Records()); got != 1400 {
		t.Fatalf("known rate after a migration without a judged window = %v, want 1400 kept", got)
	}
	finish("secrets", 700)
	if got := knownRate(l.Records()); got != 700 {
		t.Fatalf("known rate = %v, want the latest record's 700 (a cluster slower than before)", got)
	}
	finish("configmaps", 1100)

	// A new leader reads the records from the published state.
	data, err := json.Marshal(MigrationState{Records: l.Records()})
	if err != nil {
		t.Fatal(err)
	}
	var st MigrationState
	if err := json.Unmarshal(data, &st); err != nil {
		t.Fatal(err)
	}
	next := newLeader([]string{"secrets", "configmaps"}, now)
	next.Step(recordsLoaded{Records: st.Records})
	if got := knownRate(next.Records()); got != 1100 {
		t.Fatalf("known rate read by a new leader = %v, want 1100 (%s)", got, data)
	}
}
