package pace

import (
	"testing"
	"time"
)

// TestWatchLagIsTheAgeOfTheOldestCommitNotReached: the lag is measured from the
// migration's own commits, forgetting those the cache has reached.
func TestWatchLagIsTheAgeOfTheOldestCommitNotReached(t *testing.T) {
	var w watchLag
	at := func(ms int) time.Time { return t0.Add(time.Duration(ms) * time.Millisecond) }
	w.committed(10, at(0))
	w.committed(20, at(100))
	w.committed(30, at(200))
	for _, c := range []struct {
		cache int64
		now   int
		want  time.Duration
	}{
		{cache: 5, now: 300, want: 300 * time.Millisecond},  // none reached: the first is 300ms old
		{cache: 10, now: 400, want: 300 * time.Millisecond}, // 10 reached: 20 is 300ms old
		{cache: 25, now: 450, want: 250 * time.Millisecond}, // between commits: 30 is next
		{cache: 30, now: 500, want: 0},                      // caught up
		{cache: 29, now: 600, want: 0},                      // nothing left to wait for
	} {
		if got := w.lag(c.cache, at(c.now)); got != c.want {
			t.Errorf("cache at %d, %dms: lag %v, want %v", c.cache, c.now, got, c.want)
		}
	}
	for i := range maxLagCommits + 10 {
		w.committed(int64(100+i), at(1000+i))
	}
	if len(w.commits) != maxLagCommits {
		t.Errorf("%d commits remembered, want at most %d", len(w.commits), maxLagCommits)
	}
	if got := w.lag(99, at(2000)); got != time.Second {
		t.Errorf("lag %v with the cache behind every commit, want the oldest's age 1s", got)
	}
	w.reset()
	if got := w.lag(0, at(3000)); got != 0 {
		t.Errorf("lag %v after reset, want 0", got)
	}
	// A reading older than the commit it lacks (the cache's revision is read in the
	// background, and reported with the time it was read) is no lag.
	w.committed(40, at(5000))
	if got := w.lag(39, at(4900)); got != 0 {
		t.Errorf("lag %v from a reading taken before the commit, want 0", got)
	}
}
