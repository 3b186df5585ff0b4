package pace

import (
	"context"
	"testing"
	"time"

	"golang.org/x/time/rate"
	clocktesting "k8s.io/utils/clock/testing"
)

// TestVerifyFinishesWithinTheBudget: a paced re-scan reads at the clients' pace while
// that finishes in time, and faster once it would not: its revision would be compacted.
func TestVerifyFinishesWithinTheBudget(t *testing.T) {
	clk := clocktesting.NewFakeClock(t0)
	g := &Writer{clock: clk, pacer: newPacer(Options{})}
	g.servingBaselines = servingBaselines{RequestRead: 5 * time.Millisecond}
	g.pacer.SetServingBaseline(g.servingBaselines)
	g.pacer.rate = 10
	r := g.ReadPacer()
	ctx := context.Background()
	r.Resource(2400)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != readCost*10 {
		t.Errorf("limit %v/s with time to spare, want the pace %v/s", got, readCost*10)
	}
	clk.Step(verifyBudget - 2*time.Second)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != 1200 {
		t.Errorf("limit %v/s with 2,400 objects left and 2s to go, want 1200/s", got)
	}
	clk.Step(3 * time.Second)
	if err := r.Wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := r.limiter.Limit(); got != rate.Inf {
		t.Errorf("limit %v past the budget, want no limit", got)
	}
	var none *ReadPacer
	none.Resource(10)
	if err := none.Wait(ctx, 5); err != nil {
		t.Errorf("no pacing waited: %v", err)
	}
}
