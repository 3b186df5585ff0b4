package pace

import (
	"context"
	"testing"
	"time"

	"golang.org/x/time/rate"
)

// A batch built at a larger burst is paced, not refused, when another worker lowered
// the burst before it committed (a migration once aborted with "Wait(n=10) exceeds
// limiter's burst 1").
func TestWaitForTokensAfterTheBurstWasLowered(t *testing.T) {
	l := rate.NewLimiter(rate.Limit(1000), 10)
	l.SetBurst(1)
	ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
	defer cancel()
	if err := waitForTokens(ctx, l, 10); err != nil {
		t.Fatalf("waitForTokens(10) with burst 1: %v", err)
	}
	// The wait still honours the context.
	done, stop := context.WithCancel(t.Context())
	stop()
	if err := waitForTokens(done, rate.NewLimiter(rate.Limit(0.001), 1), 2); err == nil {
		t.Fatal("waitForTokens on a cancelled context: no error")
	}
}
