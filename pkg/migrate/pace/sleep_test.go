package pace

import (
	"context"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

// The writer waits on its own clock: a wait of an hour ends when a fake clock is
// stepped an hour, not on the wall clock, and a cancelled context ends it at once.
func TestWriterWaitsOnItsClock(t *testing.T) {
	clk := clocktesting.NewFakeClock(time.Unix(1_700_000_000, 0))
	g := NewWriter(WriterOptions{Clock: clk, MaxBatch: 1})
	done := make(chan error, 1)
	go func() { done <- g.sleep(context.Background(), time.Hour) }()
	for deadline := time.Now().Add(10 * time.Second); !clk.HasWaiters(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("the writer does not wait on its clock")
		}
	}
	clk.Step(time.Hour)
	if err := <-done; err != nil {
		t.Fatalf("the wait ended with %v", err)
	}

	ctx, cancel := context.WithCancel(context.Background())
	go func() { done <- g.sleep(ctx, time.Hour) }()
	cancel()
	if err := <-done; err != context.Canceled {
		t.Fatalf("a cancelled wait ended with %v, want context.Canceled", err)
	}
}
