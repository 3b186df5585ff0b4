package reload

import (
	"context"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/fsnotify/fsnotify"
	"k8s.io/utils/clock"
)

// Run watches the configuration file and applies changes until ctx ends. It reads the
// file once at start, after file events (debounced), every PollInterval, and after a
// refused change with exponential backoff. Without AutomaticReload it returns at once.
func (a *Agent) Run(ctx context.Context) {
	if !a.opts.AutomaticReload {
		a.log.V(2).Info("Automatic reload is off; the encryption configuration will not be watched")
		return
	}
	a.log.Info("Watching encryption provider configuration", "path", a.opts.Path,
		"pollInterval", a.opts.PollInterval, "debounce", a.opts.Debounce)
	kick := make(chan struct{}, 1)
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		a.worker(ctx, kick)
	}()
	a.watch(ctx, kick)
	wg.Wait()
}

func kickNow(kick chan<- struct{}) {
	select {
	case kick <- struct{}{}:
	default: // an attempt is already queued; it will read the newest content
	}
}

// worker performs reload attempts, one at a time, when kicked or when a retry is due.
func (a *Agent) worker(ctx context.Context, kick <-chan struct{}) {
	var (
		failures int
		failHash string
		retry    clock.Timer
		retryC   <-chan time.Time
	)
	stopRetry := func() {
		if retry != nil {
			retry.Stop()
		}
		retryC = nil
	}
	defer stopRetry()
	for {
		select {
		case <-ctx.Done():
			return
		case <-kick:
		case <-retryC:
			retryC = nil
		}
		hash, err := a.reload(ctx)
		if err == nil || ctx.Err() != nil || a.closed.Load() {
			failures, failHash = 0, ""
			stopRetry()
			continue
		}
		if hash != failHash {
			// A different content failed: its backoff starts over.
			failures, failHash = 0, hash
		}
		delay := min(retryInitial<<min(failures, 16), retryMax)
		failures++
		if retry == nil {
			retry = a.clock.NewTimer(delay)
		} else {
			retry.Reset(delay)
		}
		retryC = retry.C()
		a.log.V(2).Info("Will retry the encryption configuration reload", "after", delay)
	}
}

// watch turns file events and poll ticks into kicks until ctx ends.
func (a *Agent) watch(ctx context.Context, kick chan<- struct{}) {
	var (
		events <-chan fsnotify.Event
		errs   <-chan error
		w      *fsnotify.Watcher
	)
	if a.pollOnly {
		a.log.V(2).Info("Not watching for file events; polling only", "pollInterval", a.opts.PollInterval)
	} else if nw, err := fsnotify.NewWatcher(); err != nil {
		a.log.Error(err, "Cannot watch the encryption configuration for changes; polling only", "pollInterval", a.opts.PollInterval)
	} else {
		w = nw
		defer w.Close()
		events, errs = w.Events, w.Errors
	}
	names := a.refreshWatches(w)

	kickNow(kick) // the file may have changed since NewAgent read it

	poll := a.clock.NewTimer(a.opts.PollInterval)
	defer poll.Stop()
	debounce := a.clock.NewTimer(a.opts.Debounce)
	debounce.Stop()
	defer debounce.Stop()
	var (
		debounceC  <-chan time.Time
		burstStart time.Time
	)
	maxWait := a.opts.Debounce * maxDebounceWaitFactor

	for {
		select {
		case <-ctx.Done():
			return
		case ev, ok := <-events:
			if !ok {
				events = nil
				continue
			}
			if !names.relevant(ev.Name) {
				continue
			}
			now := a.clock.Now()
			if debounceC == nil {
				burstStart = now
			} else if now.Sub(burstStart) >= maxWait {
				continue // let the armed timer fire; a writer that never pauses is not waited for
			}
			debounce.Reset(a.opts.Debounce)
			debounceC = debounce.C()
		case err, ok := <-errs:
			if !ok {
				errs = nil
				continue
			}
			// An overflowed event queue loses events: read the file to be sure.
			a.log.Error(err, "Watching the encryption configuration", "path", a.opts.Path)
			kickNow(kick)
		case <-debounceC:
			debounceC = nil
			kickNow(kick)
			names = a.refreshWatches(w)
		case <-poll.C():
			poll.Reset(a.opts.PollInterval)
			kickNow(kick)
			names = a.refreshWatches(w)
		}
	}
}

// watchNames are the base names in the watched directories whose events may change
// what reading the configuration path returns.
type watchNames []string

func (n watchNames) relevant(path string) bool {
	base := filepath.Base(path)
	// Kubelet's ConfigMap/Secret volumes replace content by swapping the "..data"
	// symlink and its "..<timestamp>" target directory.
	return strings.HasPrefix(base, "..") || slices.Contains(n, base)
}

// refreshWatches watches the directory of the path and, when the path is a symlink,
// the directory of its target; these can change after every swap. Failures are logged
// and retried on the next poll.
func (a *Agent) refreshWatches(w *fsnotify.Watcher) watchNames {
	path, err := filepath.Abs(a.opts.Path)
	if err != nil {
		path = a.opts.Path
	}
	dirs := []string{filepath.Dir(path)}
	names := watchNames{filepath.Base(path)}
	if target, err := filepath.EvalSymlinks(path); err == nil && target != path {
		if d := filepath.Dir(target); d != dirs[0] {
			dirs = append(dirs, d)
		}
		names = append(names, filepath.Base(target))
	}
	if w == nil {
		return names
	}
	have := w.WatchList()
	for _, d := range have {
		if !slices.Contains(dirs, d) {
			_ = w.Remove(d) // may already be gone with its directory
		}
	}
	for _, d := range dirs {
		if slices.Contains(have, d) {
			continue
		}
		if err := w.Add(d); err != nil {
			a.log.Error(err, "Cannot watch directory of the encryption configuration; relying on polling",
				"dir", d, "pollInterval", a.opts.PollInterval)
		}
	}
	return names
}
