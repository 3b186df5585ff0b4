package cluster

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
)

// TestAlarmTranscripts steps the disagreement alarm (threshold 2m) through
// testdata/alarm*.txt. Every command prints the alarm's state after it.
//
//	member id=<id> [gone]   input: the member's state (parseMember); the live members
//	                        change (this apiserver is one of them)
//	tick <duration>         advance the clock
func TestAlarmTranscripts(t *testing.T) {
	datadriven.Walk(t, "testdata", func(t *testing.T, path string) {
		if !strings.HasPrefix(pathBase(path), "alarm") {
			return
		}
		now := epoch
		a := newDisagreementAlarm(2*time.Minute, now)
		members := map[string]MemberState{}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "member":
				var id string
				d.ScanArgs(t, "id", &id)
				if d.HasArg("gone") {
					delete(members, id)
				} else {
					members[id] = parseMember(t, id, d.Input, now)
				}
				a.Step(MembersChanged{Members: sortedMembers(members)})
			case "tick":
				now = now.Add(durationArg(t, d))
				a.Step(Tick{Now: now})
			default:
				d.Fatalf(t, "unknown command %q", d.Cmd)
			}
			switch {
			case a.Since().IsZero():
				return "agree"
			case a.Raised():
				return fmt.Sprintf("ALARM: disagree for %s: %s", ago(now, a.Since()), a.Detail())
			}
			return fmt.Sprintf("disagree for %s: %s", ago(now, a.Since()), a.Detail())
		})
	})
}
