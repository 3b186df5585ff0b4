package cluster

import (
	"fmt"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
)

// TestVerdictTranscripts judges cluster states with Evaluate (alarm threshold 2m), as
// `rekey status` prints them, through testdata/verdict*.txt.
//
//	member id=<id> [gone] [disagreeing=<duration>]
//	                  input: the member's state (parseMember); disagreeing: it has
//	                  published that the members disagree since that long ago
//	migration         input: the migration leader's state, lines
//	                    running <resource> <key> [<done>/<total>] [eta=<duration>]
//	                    plan <resource> <state> <key>
//	                  (no input: no leader has written one)
//	evaluate          the verdict
//	tick <duration>   advance the clock
func TestVerdictTranscripts(t *testing.T) {
	runTranscripts(t, "verdict", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		now := epoch
		members := liveMembers{}
		var mig *MigrationState
		return func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "member":
				id := members.step(t, d, now)
				if m, ok := members[id]; ok && d.HasArg("disagreeing") {
					var v string
					d.ScanArgs(t, "disagreeing", &v)
					ago, err := time.ParseDuration(v)
					if err != nil {
						d.Fatalf(t, "disagreeing=%s: %v", v, err)
					}
					m.DisagreeingSince = now.Add(-ago)
					members[id] = m
				}
				return "ok"
			case "migration":
				mig = parseMigration(t, d)
				return "ok"
			case "evaluate":
				return renderVerdict(Evaluate(members.list(), mig, now, 2*time.Minute))
			case "tick":
				now = now.Add(durationArg(t, d))
				return fmt.Sprintf("t=%s", now.Sub(epoch))
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

func parseMigration(t *testing.T, d *datadriven.TestData) *MigrationState {
	t.Helper()
	if strings.TrimSpace(d.Input) == "" {
		return nil
	}
	st := &MigrationState{Records: map[string]Record{}}
	for _, line := range strings.Split(strings.TrimSpace(d.Input), "\n") {
		f := strings.Fields(line)
		switch {
		case len(f) >= 3 && f[0] == "running":
			st.Running = &Migration{Resource: f[1], Target: parseKey(f[2])}
			for _, extra := range f[3:] {
				if eta, ok := strings.CutPrefix(extra, "eta="); ok {
					if st.Progress == nil {
						d.Fatalf(t, "%q: eta= follows <done>/<total>", line)
					}
					v, err := time.ParseDuration(eta)
					if err != nil {
						d.Fatalf(t, "%q: %v", line, err)
					}
					st.Progress.ETA = v
					continue
				}
				done, total, _ := strings.Cut(extra, "/")
				dn, err1 := strconv.ParseInt(done, 10, 64)
				tt, err2 := strconv.ParseInt(total, 10, 64)
				if err1 != nil || err2 != nil {
					d.Fatalf(t, "%q: want <done>/<total>", line)
				}
				st.Progress = &Progress{Resource: f[1], Done: dn, Total: tt}
			}
		case len(f) == 4 && f[0] == "plan":
			st.Plans = append(st.Plans, Plan{Resource: f[1], State: f[2], Target: parseKey(f[3])})
		default:
			d.Fatalf(t, "migration line %q: want running or plan", line)
		}
	}
	return st
}

func renderVerdict(v Verdict) string {
	s := fmt.Sprintf("converged=%t alarm=%t members=%d\nsummary: %s\n", v.Converged, v.Alarm, v.Members, v.Summary)
	if v.Disagreement != "" {
		s += "disagreement: " + v.Disagreement + "\n"
	}
	for _, w := range v.Warnings {
		s += "warning: " + w + "\n"
	}
	return s
}

// A read-only entry with two check values (here a KMS v1 socket path being rolled) is a
// warning of the verdict, not a disagreement: the alarm, which a conflict raises at
// once, stays down.
func TestReadOnlyConflictRaisesNoAlarm(t *testing.T) {
	a := parseMember(t, "a", "secrets: *aesgcm/k1, kmsv1/old#e2", epoch)
	b := parseMember(t, "b", "secrets: *aesgcm/k1, kmsv1/old#e1", epoch)
	alarm := newDisagreementAlarm(2*time.Minute, epoch)
	alarm.Step(membersChanged{Members: []MemberState{a, b}})
	alarm.Step(tick{Now: epoch.Add(time.Hour)})
	if alarm.Raised() || !alarm.Since().IsZero() {
		t.Errorf("alarm raised=%t since=%s (%s), want down", alarm.Raised(), alarm.Since(), alarm.Detail())
	}
	// The same with a key someone writes with: raised at once, as before.
	a = parseMember(t, "a", "secrets: *aesgcm/k1#s2", epoch)
	b = parseMember(t, "b", "secrets: *aesgcm/k1", epoch)
	alarm = newDisagreementAlarm(2*time.Minute, epoch)
	alarm.Step(membersChanged{Members: []MemberState{a, b}})
	if !alarm.Raised() {
		t.Error("a conflict of a written key raised no alarm")
	}
}
