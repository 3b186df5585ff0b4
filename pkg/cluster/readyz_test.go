package cluster

import (
	"strings"
	"testing"

	"github.com/cockroachdb/datadriven"
)

// TestReadinessTranscripts judges readiness (missingKeys, the reasons /readyz fails)
// of every live member through testdata/readyz*.txt.
//
//	member id=<id> [gone]   input: the member's state (parseMember)
//	ready                   each member's readiness, by id
func TestReadinessTranscripts(t *testing.T) {
	runTranscripts(t, "readyz", func(t *testing.T) func(*testing.T, *datadriven.TestData) string {
		members := liveMembers{}
		return func(t *testing.T, d *datadriven.TestData) string {
			switch d.Cmd {
			case "member":
				members.step(t, d, epoch)
				return "ok"
			case "ready":
				var b strings.Builder
				for _, m := range members.list() {
					missing := missingKeys(m, members.list(), nil)
					if len(missing) == 0 {
						b.WriteString(m.APIServerID + ": ready\n")
						continue
					}
					b.WriteString(m.APIServerID + ": NOT READY: " + strings.Join(missing, "; ") + "\n")
				}
				return b.String()
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}
