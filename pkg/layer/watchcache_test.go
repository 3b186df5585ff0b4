package layer

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/runtime/schema"
	cachermetrics "k8s.io/apiserver/pkg/storage/cacher/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	clocktesting "k8s.io/utils/clock/testing"
)

// The layer reads k8s.io/apiserver's own gauge, registered and set by its own code:
// a rename of the metric or of its labels upstream fails here, not silently in a
// migration that no longer sees its watch cache.
func TestWatchCacheRevisionsReadsUpstreamsGauge(t *testing.T) {
	cachermetrics.Register()
	// A group no apiserver in this test binary serves: the registry is process-wide.
	widgets := schema.GroupResource{Group: "watchcache-test.rekey.io", Resource: "widgets"}
	gadgets := schema.GroupResource{Group: "watchcache-test.rekey.io", Resource: "gadgets"}
	cachermetrics.RecordResourceVersion(widgets, 123456789)
	cachermetrics.RecordResourceVersion(gadgets, 42)

	w := newWatchCacheRevisions(legacyregistry.DefaultGatherer, clocktesting.NewFakePassiveClock(time.Now()))
	for gr, want := range map[schema.GroupResource]int64{widgets: 123456789, gadgets: 42} {
		if rev, ok := w.Revision(gr); !ok || rev != want {
			t.Errorf("Revision(%s) = %d, %v; want %d, true", gr, rev, ok, want)
		}
	}
	if rev, ok := w.Revision(schema.GroupResource{Group: "watchcache-test.rekey.io", Resource: "uncached"}); ok {
		t.Errorf("a resource without a watch cache read as revision %d; want not ok", rev)
	}
}

// newRevisionGauge registers a gauge shaped like k8s.io/apiserver's in a registry of
// the test's own.
func newRevisionGauge(t *testing.T) (*prometheus.Registry, *prometheus.GaugeVec) {
	t.Helper()
	reg := prometheus.NewRegistry()
	g := prometheus.NewGaugeVec(prometheus.GaugeOpts{Name: watchCacheRevisionMetric, Help: "test"}, []string{"group", "resource"})
	reg.MustRegister(g)
	return reg, g
}

func TestWatchCacheRevisionsReadTheGaugeAtMostEvery250ms(t *testing.T) {
	reg, g := newRevisionGauge(t)
	gatherer := &countingGatherer{Gatherer: reg}
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	w := newWatchCacheRevisions(gatherer, clk)
	secrets := schema.GroupResource{Resource: "secrets"}

	g.WithLabelValues("", "secrets").Set(10)
	if rev, ok := w.Revision(secrets); !ok || rev != 10 {
		t.Fatalf("Revision = %d, %v; want 10, true", rev, ok)
	}
	g.WithLabelValues("", "secrets").Set(20)
	clk.SetTime(clk.Now().Add(watchCacheReadEvery - time.Millisecond))
	for range 100 {
		if rev, _ := w.Revision(secrets); rev != 10 {
			t.Fatalf("Revision = %d within %v of the last read; want the value read then, 10", rev, watchCacheReadEvery)
		}
	}
	if gatherer.calls != 1 {
		t.Errorf("the registry was gathered %d times within %v; want once", gatherer.calls, watchCacheReadEvery)
	}
	clk.SetTime(clk.Now().Add(time.Millisecond))
	if rev, _ := w.Revision(secrets); rev != 20 {
		t.Errorf("Revision = %d after %v; want the new value, 20", rev, watchCacheReadEvery)
	}
	// A resource whose cache appears later is seen at the next read.
	g.WithLabelValues("apps", "deployments").Set(30)
	clk.SetTime(clk.Now().Add(watchCacheReadEvery))
	if rev, ok := w.Revision(schema.GroupResource{Group: "apps", Resource: "deployments"}); !ok || rev != 30 {
		t.Errorf("Revision(deployments.apps) = %d, %v; want 30, true", rev, ok)
	}
}

// A registry that fails on some collector still hands back the families it read;
// the gauge among them is used.
func TestWatchCacheRevisionsUseWhatAFailedGatherRead(t *testing.T) {
	reg, g := newRevisionGauge(t)
	g.WithLabelValues("", "configmaps").Set(77)
	w := newWatchCacheRevisions(failingGatherer{reg}, clocktesting.NewFakePassiveClock(time.Now()))
	if rev, ok := w.Revision(schema.GroupResource{Resource: "configmaps"}); !ok || rev != 77 {
		t.Errorf("Revision = %d, %v; want 77, true", rev, ok)
	}
	if _, ok := w.Revision(schema.GroupResource{Resource: "secrets"}); ok {
		t.Error("a resource missing from the gauge read as cached")
	}
}

type countingGatherer struct {
	prometheus.Gatherer
	calls int
}

func (c *countingGatherer) Gather() ([]*dto.MetricFamily, error) {
	c.calls++
	return c.Gatherer.Gather()
}

type failingGatherer struct{ prometheus.Gatherer }

func (f failingGatherer) Gather() ([]*dto.MetricFamily, error) {
	mfs, _ := f.Gatherer.Gather()
	return mfs, errors.New("a collector failed")
}
