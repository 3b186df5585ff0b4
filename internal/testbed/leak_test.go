package testbed

import (
	"os/exec"
	"strings"
	"testing"
	"time"
)

// Stop takes the process's group with it, and Leaked finds what escaped the group.
func TestStopKillsTheGroupAndLeakedFindsTheRest(t *testing.T) {
	if _, err := exec.LookPath("setsid"); err != nil {
		t.Skip("setsid(1) is not installed")
	}
	dir := t.TempDir()
	// A child in the group (sleep 61 &) and one that leaves it (setsid sleep 62 &).
	p, err := Start("leaker", dir, "sh", "-c", "sleep 61 & setsid sleep 62 & exec sleep 60")
	if err != nil {
		t.Fatal(err)
	}
	defer KillLeaked()
	waitFor(t, func() bool { return len(leakedCommands(t)) == 3 }, "the three sleeps to start")
	p.Stop(5 * time.Second)
	waitFor(t, func() bool {
		got := leakedCommands(t)
		return len(got) == 1 && got[0] == "sleep 62"
	}, "only the sleep that left the process group to be left")
	killed, err := KillLeaked()
	if err != nil || len(killed) != 1 {
		t.Fatalf("KillLeaked: %v, %v", killed, err)
	}
	waitFor(t, func() bool { return len(leakedCommands(t)) == 0 }, "nothing left after KillLeaked")
}

func leakedCommands(t *testing.T) []string {
	t.Helper()
	l, err := Leaked()
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range l {
		out = append(out, strings.TrimSpace(p.Command))
	}
	return out
}

func waitFor(t *testing.T, cond func() bool, what string) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s (leaked: %v)", what, leakedCommands(t))
		}
		time.Sleep(20 * time.Millisecond)
	}
}
