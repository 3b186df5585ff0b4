package kmsv2

import (
	"context"
	"strings"
	"sync"
	"testing"
	"time"

	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/healthz"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The /healthz check in front of a real provider and plugin has exactly one cache, with
// upstream's periods: a success is served for 20 s from the Status that produced it, a
// failure for 3 s, and a storm of checks after expiry costs one Status. With a second
// cache in front of the provider's, a plugin that turns unhealthy would be reported up
// to another 20 s late.
func TestOneHealthCacheInFrontOfThePlugin(t *testing.T) {
	tp := startPlugin(t, "key-1")
	clk := testingclock.NewFakeClock(time.Now())
	p := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{Clock: clk}, FactoryOptions{})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	c := healthz.New(healthz.Options{})
	c.Swap(p)
	statuses := tp.Stats().Status // the loop's first Status, at the start
	check := func(wantErr string, wantStatuses int64) {
		t.Helper()
		err := c.CheckContext(ctx)
		switch {
		case wantErr == "" && err != nil:
			t.Fatalf("check: %v, want healthy", err)
		case wantErr != "" && (err == nil || !strings.Contains(err.Error(), wantErr)):
			t.Fatalf("check: %v, want an error containing %q", err, wantErr)
		}
		if got := tp.Stats().Status; got != statuses+wantStatuses {
			t.Fatalf("%d Status calls since the start, want %d", got-statuses, wantStatuses)
		}
	}

	clk.Step(DefaultHealthyTTL - time.Second)
	check("", 0) // served from the start's Status
	tp.SetFaults(kmsplugin.Faults{StatusHealthz: "sick"})
	clk.Step(time.Second + time.Millisecond)
	check("sick", 1) // the success expired 20 s after its Status: ask the plugin
	tp.SetFaults(kmsplugin.Faults{})
	clk.Step(DefaultUnhealthyTTL - time.Millisecond)
	check("sick", 1)
	clk.Step(time.Millisecond)
	check("", 2) // the failure expired after 3 s

	clk.Step(DefaultHealthyTTL)
	var wg sync.WaitGroup
	errs := make(chan error, 50)
	for range 50 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- c.CheckContext(ctx)
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		if err != nil {
			t.Fatalf("storm: %v", err)
		}
	}
	check("", 3) // 50 concurrent checks shared one Status
}
