package cluster

import (
	"fmt"
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
	runTranscripts(t, "alarm", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		now := epoch
		a := newDisagreementAlarm(2*time.Minute, now)
		members := liveMembers{}
		return func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "member":
				members.step(t, d, now)
				a.Step(membersChanged{Members: members.list()})
			case "tick":
				now = now.Add(durationArg(t, d))
				a.Step(tick{Now: now})
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
		}
	})
}
