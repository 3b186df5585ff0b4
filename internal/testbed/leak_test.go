package testbed

import (
	"errors"
	"os/exec"
	"slices"
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
	// Each by its own command line: counting three processes also passed while the
	// third was still setsid(1) in the group, about to leave it, and Stop then killed it
	// with the group (nothing left to find, a flake of a loaded CI run).
	waitFor(t, func() bool {
		got := leakedCommands(t)
		slices.Sort(got)
		return slices.Equal(got, []string{"sleep 60", "sleep 61", "sleep 62"})
	}, "the three sleeps to start")
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

// A start that lost its port to another process is tried again on fresh ports, a few
// times; any other failure is returned at once.
func TestRetryLostPort(t *testing.T) {
	lost := errors.New("etcd exited (exit status 1); log tail: listen tcp 127.0.0.1:23456: bind: address already in use")
	calls := 0
	got, err := retryLostPort(func() (int, error) {
		if calls++; calls < 3 {
			return 0, lost
		}
		return calls, nil
	})
	if err != nil || got != 3 {
		t.Fatalf("retryLostPort = %d, %v after %d calls; want success on the third", got, err, calls)
	}
	calls = 0
	if _, err := retryLostPort(func() (int, error) { calls++; return 0, lost }); !errors.Is(err, lost) || calls != lostPortAttempts {
		t.Fatalf("always losing the port: %v after %d calls; want the error after %d", err, calls, lostPortAttempts)
	}
	calls = 0
	other := errors.New("etcd not ready: context deadline exceeded")
	if _, err := retryLostPort(func() (int, error) { calls++; return 0, other }); !errors.Is(err, other) || calls != 1 {
		t.Fatalf("another failure: %v after %d calls; want it returned after 1", err, calls)
	}
}
