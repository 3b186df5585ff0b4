package layer

import (
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/utils/clock"
)

// watchCacheRevisionMetric is k8s.io/apiserver's gauge of the etcd revision each watch
// cache has reached, labelled group and resource.
const watchCacheRevisionMetric = "apiserver_watch_cache_resource_version"

// watchCacheReadEvery bounds how often the gauge is read: a gather walks every metric
// the apiserver registered, and the pacer judges once a second.
const watchCacheReadEvery = 250 * time.Millisecond

// watchCacheRevisions tells migrations how far the apiserver's watch caches have got
// (pace.WatchCacheRevision). k8s.io/apiserver keeps no handle on its caches that an
// embedded layer could ask, but it reports their revisions as a metric; that is read.
//
// A gather runs every collector of the apiserver's registry, and some do I/O:
// k8s.io/apiserver's storage size collector asks a random etcd endpoint for its status
// with a 1 s timeout per storage backend, so with one etcd member down a gather takes
// seconds. Revision therefore never gathers on its caller's path: it answers with the
// last reading and the time it was taken, and starts the next reading in the
// background when that one is older than watchCacheReadEvery (one at a time).
type watchCacheRevisions struct {
	metrics prometheus.Gatherer
	clock   clock.PassiveClock

	mu      sync.Mutex
	read    time.Time // when the last reading started
	revs    map[schema.GroupResource]int64
	reading bool
	// done is told when a background reading ends (tests wait on it); nil: nobody is.
	done chan<- struct{}
}

func newWatchCacheRevisions(g prometheus.Gatherer, clk clock.PassiveClock) *watchCacheRevisions {
	if clk == nil {
		clk = clock.RealClock{}
	}
	return &watchCacheRevisions{metrics: g, clock: clk}
}

// Revision is the revision the watch cache of gr had reached at the time returned; ok
// is false when the apiserver has no watch cache of gr, the metric could not be read,
// or the first reading has not ended yet. It never waits for a reading.
func (w *watchCacheRevisions) Revision(gr schema.GroupResource) (int64, time.Time, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now := w.clock.Now(); !w.reading && (w.read.IsZero() || now.Sub(w.read) >= watchCacheReadEvery) {
		w.reading = true
		go w.gather(now)
	}
	rev, ok := w.revs[gr]
	return rev, w.read, ok
}

// gather takes a reading that started at start: the gauge's value is at least what
// the caches had reached then.
func (w *watchCacheRevisions) gather(start time.Time) {
	revs := map[schema.GroupResource]int64{}
	// A gather error can come with every family it could read: use what is there.
	families, _ := w.metrics.Gather()
	for _, f := range families {
		if f.GetName() != watchCacheRevisionMetric {
			continue
		}
		for _, m := range f.GetMetric() {
			var gr schema.GroupResource
			for _, l := range m.GetLabel() {
				switch l.GetName() {
				case "group":
					gr.Group = l.GetValue()
				case "resource":
					gr.Resource = l.GetValue()
				}
			}
			if g := m.GetGauge(); g != nil {
				revs[gr] = int64(g.GetValue())
			}
		}
	}
	w.mu.Lock()
	w.read, w.revs, w.reading = start, revs, false
	done := w.done
	w.mu.Unlock()
	if done != nil {
		done <- struct{}{}
	}
}
