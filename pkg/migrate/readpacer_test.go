package migrate

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
	g := &gentle{clock: clk, pacer: newPacer(PacingOptions{})}
	g.servingBaseline = 5 * time.Millisecond
	g.pacer.SetServingBaseline(g.servingBaseline)
	g.pacer.rate = 10
	r := g.readPacer()
	ctx := context.Background()
	r.resource(2400)
	if err := r.wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != readCost*10 {
		t.Errorf("limit %v/s with time to spare, want the pace %v/s", got, readCost*10)
	}
	clk.Step(verifyBudget - 2*time.Second)
	if err := r.wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := float64(r.limiter.Limit()); got != 1200 {
		t.Errorf("limit %v/s with 2,400 objects left and 2s to go, want 1200/s", got)
	}
	clk.Step(3 * time.Second)
	if err := r.wait(ctx, 0); err != nil {
		t.Fatal(err)
	}
	if got := r.limiter.Limit(); got != rate.Inf {
		t.Errorf("limit %v past the budget, want no limit", got)
	}
	var none *readPacer
	none.resource(10)
	if err := none.wait(ctx, 5); err != nil {
		t.Errorf("no pacing waited: %v", err)
	}
}
