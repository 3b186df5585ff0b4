package pace

// How far the apiserver's watch cache is behind the migration, as a signal for the
// pacer. Every object a migration rewrites is a watch event that the apiserver's cache
// of the resource decrypts, decodes and hands to every watcher (kubelets watching
// Secrets, controllers), one event at a time. A migration that writes faster than the
// cache takes events in does not finish sooner: the events queue up, and every watcher
// sees the cluster's own changes late. On an idle cluster no client request is slow
// and etcd's transactions stay fast while that queue grows.

import (
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
)

// WatchCacheRevision reports the etcd revision the apiserver's watch cache of a
// resource had reached at the time at; ok is false when the resource has none (or none
// yet). It is called on the migration's write path: it must answer at once, with the
// last reading it has, never wait for a new one.
type WatchCacheRevision func(gr schema.GroupResource) (rev int64, at time.Time, ok bool)

// DefaultMaxWatchLag: a window in which the apiserver's watch cache was further behind
// the migration's own writes than this is congestion.
const DefaultMaxWatchLag = time.Second

// maxLagCommits bounds the commits remembered while the cache is behind; the oldest
// alone says how far behind it is.
const maxLagCommits = 4096

// watchLag is how long ago the oldest of the migration's own commits that the watch
// cache has not reached yet was made: the delay a watcher of the resource sees now. A
// record the driver feeds; it reads no clock.
type watchLag struct {
	commits []revisionAt // ascending revisions
}

type revisionAt struct {
	rev int64
	at  time.Time
}

// committed records a commit of the migration at revision rev.
func (w *watchLag) committed(rev int64, at time.Time) {
	if len(w.commits) < maxLagCommits {
		w.commits = append(w.commits, revisionAt{rev, at})
	}
}

// lag is the delay of a cache at revision cache; the commits it reached are forgotten.
func (w *watchLag) lag(cache int64, now time.Time) time.Duration {
	i := 0
	for i < len(w.commits) && w.commits[i].rev <= cache {
		i++
	}
	w.commits = append(w.commits[:0], w.commits[i:]...)
	if len(w.commits) == 0 {
		return 0
	}
	// A reading taken before the oldest commit it lacks was made says nothing late.
	return max(0, now.Sub(w.commits[0].at))
}

// reset forgets every commit (a new resource: another cache).
func (w *watchLag) reset() { w.commits = w.commits[:0] }
