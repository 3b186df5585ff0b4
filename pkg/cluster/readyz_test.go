package cluster

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// TestReadinessTranscripts judges readiness (missingKeys, the reasons /readyz fails)
// of every live member through testdata/readyz*.txt, with the warnings of what it lets
// pass (readinessWarnings).
//
//	member id=<id> [gone]   input: the member's state (parseMember)
//	ready                   each member's readiness, by id, then its warnings
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
					} else {
						b.WriteString(m.APIServerID + ": NOT READY: " + strings.Join(missing, "; ") + "\n")
					}
					for _, w := range readinessWarnings(m, members.list()) {
						b.WriteString("  WARNING: " + w + "\n")
					}
				}
				return b.String()
			}
			d.Fatalf(t, "unknown command %q", d.Cmd)
			return ""
		}
	})
}

// TestKMSv1EndpointRollStaysReady: three apiservers move their KMS v1 provider to
// another socket path one by one. Nobody writes with KMS v1, so every one of them
// stays ready throughout, while the status documents warn of the differing endpoints;
// another spelling of the same socket (unix:/x for unix:///x) is no difference at all.
func TestKMSv1EndpointRollStaysReady(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	withV1 := func(endpoint string) string {
		return secretsConfig("k1") + "  - kms: {name: old, endpoint: '" + endpoint + "'}\n"
	}
	const oldPath, newPath = "unix:///tmp/rekey-test-old.sock", "unix:///tmp/rekey-test-new.sock"
	var members []*member
	for _, id := range []string{"a", "b", "c"} {
		members = append(members, startMember(t, cli, id, withV1(oldPath)))
	}
	// check waits until every member sees the others' latest records, then requires
	// each to be ready, with a warning exactly when the endpoints differ.
	check := func(step string, warn bool) {
		t.Helper()
		eventually(t, step+": every member sees every other's configuration", func() bool {
			for _, m := range members {
				seen := map[string]string{}
				for _, s := range m.node.view.Members() {
					seen[s.APIServerID] = s.ConfigHash
				}
				for _, o := range members {
					if seen[o.id] != o.node.state(time.Time{}).ConfigHash {
						return false
					}
				}
			}
			return true
		})
		for _, m := range members {
			if err := m.node.ReadyzCheck().Check(nil); err != nil {
				t.Errorf("%s: %s is not ready: %v", step, m.id, err)
			}
			w := m.node.Status().Warnings
			if warn != (len(w) > 0) || warn && !strings.Contains(w[0], "kmsv1/old has 2 endpoints") {
				t.Errorf("%s: %s warns %q, want a warning: %t", step, m.id, w, warn)
			}
		}
	}
	check("all on the old path", false)
	for i, m := range members {
		writeFile(t, m.path, withV1(newPath))
		if err := m.agent.Reload(context.Background()); err != nil {
			t.Fatalf("%s moves to the new path: %v", m.id, err)
		}
		check(m.id+" on the new path", i < len(members)-1)
	}
	// unix:/x names the socket unix:///x names: one check value, no warning.
	writeFile(t, members[1].path, withV1(strings.Replace(newPath, "unix:///", "unix:/", 1)))
	if err := members[1].agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	check("b spells the path unix:/", false)
}
