package layer

import (
	"errors"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	dto "github.com/prometheus/client_model/go"
	"k8s.io/apimachinery/pkg/runtime/schema"
	cachermetrics "k8s.io/apiserver/pkg/storage/cacher/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"
)

// newTestRevisions is a watchCacheRevisions whose background readings the test waits
// for with the returned function.
func newTestRevisions(g prometheus.Gatherer, clk clock.PassiveClock) (*watchCacheRevisions, func(*testing.T)) {
	done := make(chan struct{}, 16)
	w := newWatchCacheRevisions(g, clk)
	w.done = done
	return w, func(t *testing.T) {
		t.Helper()
		select {
		case <-done:
		case <-time.After(10 * time.Second):
			t.Fatal("no reading of the registry ended within 10s")
		}
	}
}

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

	w, readingEnded := newTestRevisions(legacyregistry.DefaultGatherer, clocktesting.NewFakePassiveClock(time.Now()))
	if _, _, ok := w.Revision(widgets); ok {
		t.Fatal("a revision before the first reading ended")
	}
	readingEnded(t)
	for gr, want := range map[schema.GroupResource]int64{widgets: 123456789, gadgets: 42} {
		if rev, _, ok := w.Revision(gr); !ok || rev != want {
			t.Errorf("Revision(%s) = %d, %v; want %d, true", gr, rev, ok, want)
		}
	}
	if rev, _, ok := w.Revision(schema.GroupResource{Group: "watchcache-test.rekey.io", Resource: "uncached"}); ok {
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
	start := time.Unix(1000, 0)
	clk := clocktesting.NewFakePassiveClock(start)
	w, readingEnded := newTestRevisions(gatherer, clk)
	secrets := schema.GroupResource{Resource: "secrets"}

	g.WithLabelValues("", "secrets").Set(10)
	w.Revision(secrets)
	readingEnded(t)
	if rev, at, ok := w.Revision(secrets); !ok || rev != 10 || !at.Equal(start) {
		t.Fatalf("Revision = %d at %v, %v; want 10 at %v, true", rev, at, ok, start)
	}
	g.WithLabelValues("", "secrets").Set(20)
	clk.SetTime(clk.Now().Add(watchCacheReadEvery - time.Millisecond))
	for range 100 {
		if rev, _, _ := w.Revision(secrets); rev != 10 {
			t.Fatalf("Revision = %d within %v of the last read; want the value read then, 10", rev, watchCacheReadEvery)
		}
	}
	if n := gatherer.count(); n != 1 {
		t.Errorf("the registry was gathered %d times within %v; want once", n, watchCacheReadEvery)
	}
	clk.SetTime(clk.Now().Add(time.Millisecond))
	read := clk.Now()
	w.Revision(secrets) // starts the next reading
	readingEnded(t)
	if rev, at, _ := w.Revision(secrets); rev != 20 || !at.Equal(read) {
		t.Errorf("Revision = %d at %v after %v; want the new value, 20, read at %v", rev, at, watchCacheReadEvery, read)
	}
	// A resource whose cache appears later is seen at the next read.
	g.WithLabelValues("apps", "deployments").Set(30)
	clk.SetTime(clk.Now().Add(watchCacheReadEvery))
	w.Revision(secrets)
	readingEnded(t)
	if rev, _, ok := w.Revision(schema.GroupResource{Group: "apps", Resource: "deployments"}); !ok || rev != 30 {
		t.Errorf("Revision(deployments.apps) = %d, %v; want 30, true", rev, ok)
	}
}

// A slow registry (a collector waiting on a down etcd member) never holds the caller:
// Revision answers with the last reading while the next one runs, and starts no second
// one meanwhile.
func TestWatchCacheRevisionsNeverWaitForASlowGather(t *testing.T) {
	reg, g := newRevisionGauge(t)
	g.WithLabelValues("", "secrets").Set(5)
	release := make(chan struct{})
	slow := &blockingGatherer{Gatherer: reg, release: release}
	clk := clocktesting.NewFakePassiveClock(time.Unix(1000, 0))
	w, readingEnded := newTestRevisions(slow, clk)
	secrets := schema.GroupResource{Resource: "secrets"}
	close(release) // the first reading is quick
	w.Revision(secrets)
	readingEnded(t)

	slow.release = make(chan struct{}) // the next ones hang until released
	g.WithLabelValues("", "secrets").Set(6)
	for range 10 {
		clk.SetTime(clk.Now().Add(watchCacheReadEvery))
		done := make(chan int64)
		go func() { rev, _, _ := w.Revision(secrets); done <- rev }()
		select {
		case rev := <-done:
			if rev != 5 {
				t.Fatalf("Revision = %d while the next reading hangs; want the last one read, 5", rev)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("Revision waited for a hanging gather")
		}
	}
	// The second gather is started by the first call above and hangs; no call since
	// started a third.
	deadline := time.Now().Add(5 * time.Second)
	for slow.count() < 2 && time.Now().Before(deadline) {
		time.Sleep(time.Millisecond)
	}
	if n := slow.count(); n != 2 {
		t.Errorf("%d gathers started; want 2 (one at a time)", n)
	}
	close(slow.release)
	readingEnded(t)
	if rev, _, _ := w.Revision(secrets); rev != 6 {
		t.Errorf("Revision = %d after the hanging reading ended; want 6", rev)
	}
}

// A registry that fails on some collector still hands back the families it read;
// the gauge among them is used.
func TestWatchCacheRevisionsUseWhatAFailedGatherRead(t *testing.T) {
	reg, g := newRevisionGauge(t)
	g.WithLabelValues("", "configmaps").Set(77)
	w, readingEnded := newTestRevisions(failingGatherer{reg}, clocktesting.NewFakePassiveClock(time.Now()))
	w.Revision(schema.GroupResource{Resource: "configmaps"})
	readingEnded(t)
	if rev, _, ok := w.Revision(schema.GroupResource{Resource: "configmaps"}); !ok || rev != 77 {
		t.Errorf("Revision = %d, %v; want 77, true", rev, ok)
	}
	if _, _, ok := w.Revision(schema.GroupResource{Resource: "secrets"}); ok {
		t.Error("a resource missing from the gauge read as cached")
	}
}

type countingGatherer struct {
	prometheus.Gatherer
	mu    sync.Mutex
	calls int
}

func (c *countingGatherer) Gather() ([]*dto.MetricFamily, error) {
	c.mu.Lock()
	c.calls++
	c.mu.Unlock()
	return c.Gatherer.Gather()
}

func (c *countingGatherer) count() int {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.calls
}

// blockingGatherer gathers once release is closed (read when the gather starts).
type blockingGatherer struct {
	prometheus.Gatherer
	mu      sync.Mutex
	calls   int
	release chan struct{}
}

func (b *blockingGatherer) Gather() ([]*dto.MetricFamily, error) {
	b.mu.Lock()
	b.calls++
	release := b.release
	b.mu.Unlock()
	<-release
	return b.Gatherer.Gather()
}

func (b *blockingGatherer) count() int {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.calls
}

type failingGatherer struct{ prometheus.Gatherer }

func (f failingGatherer) Gather() ([]*dto.MetricFamily, error) {
	mfs, _ := f.Gatherer.Gather()
	return mfs, errors.New("a collector failed")
}
