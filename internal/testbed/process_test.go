package testbed

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

// CPUTime agrees with the kernel's own account of this process (getrusage), which a
// busy loop grows by 200 ms: however loaded the machine (the loop runs until the
// process really got that much CPU, not for a wall time).
func TestCPUTimeCountsTheProcessesWork(t *testing.T) {
	before, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	rBefore := rusageCPU(t)
	deadline := time.Now().Add(30 * time.Second)
	x := 0
	for rusageCPU(t)-rBefore < 200*time.Millisecond && time.Now().Before(deadline) {
		for range 100000 {
			x++ // busy
		}
	}
	if x < 0 {
		t.Log(x) // keeps the loop's work
	}
	after, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	want := rusageCPU(t) - rBefore
	// /proc counts in ticks of 10 ms, getrusage in microseconds: allow a few ticks.
	if used := after - before; used < want-50*time.Millisecond || used > want+50*time.Millisecond {
		t.Errorf("CPUTime grew by %v while getrusage counted %v", used, want)
	}
	if _, err := CPUTime(-1); err == nil {
		t.Error("CPUTime of no process: no error")
	}
}

func rusageCPU(t *testing.T) time.Duration {
	t.Helper()
	var ru syscall.Rusage
	if err := syscall.Getrusage(syscall.RUSAGE_SELF, &ru); err != nil {
		t.Fatal(err)
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}

// A $REKEY_TESTBED_KEEP_LOGS that does not exist yet is created, and the process's
// output lands in it (a developer's first run with a fresh directory must not fail
// to start etcd).
func TestKeptLogsGoToAFreshDirectory(t *testing.T) {
	keep := filepath.Join(t.TempDir(), "not", "yet")
	t.Setenv(keepLogsEnv, keep)
	p, err := Start("echo", t.TempDir(), "/bin/sh", "-c", "echo kept")
	if err != nil {
		t.Fatalf("Start with a kept-logs directory that does not exist: %v", err)
	}
	<-p.Done()
	if filepath.Dir(p.LogPath) != keep {
		t.Errorf("log at %s, want it in %s", p.LogPath, keep)
	}
	b, err := os.ReadFile(p.LogPath)
	if err != nil || !strings.Contains(string(b), "kept") {
		t.Errorf("log %s holds %q (%v), want the process's output", p.LogPath, b, err)
	}
}
