package cluster

import (
	"fmt"
	"strconv"
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"
)

// TestLeaderTranscripts steps the migration leader through testdata/leader*.txt.
//
//	leading / not-leading
//	member id=<id> [gone]          input: the member's rules, as in the fence transcripts
//	inventory resource=<r>         input: "<key>: <objects>" lines, taken now
//	ready                          what the leader would start now (Ready; nothing changes)
//	started                        the driver started what ready said (migrationStarted)
//	next                           ready, then started
//	finished resource=<r> [error=<text>]
//	tick <duration>
//	plans                          every resource's plan
func TestLeaderTranscripts(t *testing.T) {
	runTranscripts(t, "leader", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		now := epoch
		l := newLeader([]string{"secrets", "configmaps"}, now)
		members := liveMembers{}
		var ready Migration // what the latest ready or next said
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
				ev := inventoryTaken{Resource: res, TakenAt: now}
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
				l.Step(migrationFinished{Resource: res, Target: m.Target, Err: errText})
				rec := l.Records()[res]
				return fmt.Sprintf("record %s: target %s verified=%v", res, rec.Target, rec.Verified)
			case "tick":
				now = now.Add(durationArg(t, d))
				l.Step(tick{Now: now})
				return fmt.Sprintf("t=%s", now.Sub(epoch))
			case "plans":
				return renderPlans(l)
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
