package testbed

import (
	"os"
	"runtime"
	"testing"
	"time"
)

func TestCPUTimeCountsTheProcessesWork(t *testing.T) {
	before, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	x := 0
	for time.Since(start) < 300*time.Millisecond {
		x++ // busy: one core's worth of CPU for 300 ms
	}
	wall := time.Since(start)
	if x < 0 {
		t.Log(x) // keeps the loop's work
	}
	after, err := CPUTime(os.Getpid())
	if err != nil {
		t.Fatal(err)
	}
	// A busy loop of 300 ms is at least ~150 ms of CPU even on a loaded machine; the
	// whole test process cannot have used more than its cores allow.
	if used := after - before; used < 150*time.Millisecond || used > wall*time.Duration(runtime.NumCPU())+100*time.Millisecond {
		t.Errorf("CPU time grew by %v over a %v busy loop", used, wall)
	}
	if _, err := CPUTime(-1); err == nil {
		t.Error("CPUTime of no process: no error")
	}
}
