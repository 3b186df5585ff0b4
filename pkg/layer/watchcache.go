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
// (migrate.WatchCacheRevision). k8s.io/apiserver keeps no handle on its caches that an
// embedded layer could ask, but it reports their revisions as a metric; that is read.
type watchCacheRevisions struct {
	metrics prometheus.Gatherer
	clock   clock.PassiveClock

	mu   sync.Mutex
	read time.Time
	revs map[schema.GroupResource]int64
}

func newWatchCacheRevisions(g prometheus.Gatherer, clk clock.PassiveClock) *watchCacheRevisions {
	if clk == nil {
		clk = clock.RealClock{}
	}
	return &watchCacheRevisions{metrics: g, clock: clk}
}

// Revision is the revision the watch cache of gr has reached; ok is false when the
// apiserver has no watch cache of gr (or the metric could not be read).
func (w *watchCacheRevisions) Revision(gr schema.GroupResource) (int64, bool) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if now := w.clock.Now(); w.revs == nil || now.Sub(w.read) >= watchCacheReadEvery {
		w.read, w.revs = now, w.gather()
	}
	rev, ok := w.revs[gr]
	return rev, ok
}

func (w *watchCacheRevisions) gather() map[schema.GroupResource]int64 {
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
	return revs
}
