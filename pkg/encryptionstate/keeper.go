package encryptionstate

import (
	"context"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/api/equality"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/api/v1alpha1"
)

// Publisher stores the cluster's EncryptionState: the binary's way of serving it.
type Publisher interface {
	// Publish makes the stored object's status st, creating the object if needed, and
	// reports whether it wrote (false: the stored status was already st).
	Publish(ctx context.Context, st v1alpha1.EncryptionStateStatus) (wrote bool, err error)
}

// DefaultInterval is how often a Keeper compares what it would publish with what it
// published: a comparison in memory; only a change is written.
const DefaultInterval = 2 * time.Second

// publishTimeout bounds one Publish.
const publishTimeout = 10 * time.Second

// KeeperOptions configure a Keeper.
type KeeperOptions struct {
	Publisher Publisher
	// Leading reports whether this apiserver writes the state now (the elected
	// migration leader); only a leader publishes.
	Leading func() bool
	// Input is what Build takes, read at each check.
	Input    func() Input
	Interval time.Duration
	Clock    clock.WithTicker
	// Metrics (nil: none) count the publishes and the time spent.
	Metrics *Metrics
	Logger  klog.Logger
}

// Keeper keeps the cluster's EncryptionState current while this apiserver leads: at
// each interval it builds the status from what the layer has in memory and publishes
// it when it differs from the last one published.
type Keeper struct {
	opts KeeperOptions

	mu    sync.Mutex
	last  *v1alpha1.EncryptionStateStatus
	stats Stats
}

// Stats are what keeping the state current cost this apiserver.
type Stats struct {
	// Builds counts the statuses built while leading; Writes the publishes that wrote,
	// Unchanged those the stored object already matched, Failures those that failed.
	Builds, Writes, Unchanged, Failures int64
	// BuildTime and PublishTime are the time spent building and publishing.
	BuildTime, PublishTime time.Duration
}

// NewKeeper returns a Keeper; call Run.
func NewKeeper(o KeeperOptions) *Keeper {
	if o.Interval <= 0 {
		o.Interval = DefaultInterval
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.Logger.GetSink() == nil {
		o.Logger = klog.Background()
	}
	o.Logger = o.Logger.WithName("encryption-state")
	return &Keeper{opts: o}
}

// Stats returns the counts so far.
func (k *Keeper) Stats() Stats {
	k.mu.Lock()
	defer k.mu.Unlock()
	return k.stats
}

// Run checks every interval until ctx ends.
func (k *Keeper) Run(ctx context.Context) {
	t := k.opts.Clock.NewTicker(k.opts.Interval)
	defer t.Stop()
	for {
		k.Check(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		}
	}
}

// Check publishes the current status if this apiserver leads and it changed. A
// follower forgets what it published: when it leads again, the stored object may have
// been written by another leader since, so the first check compares with it.
func (k *Keeper) Check(ctx context.Context) {
	if !k.opts.Leading() {
		k.mu.Lock()
		k.last = nil
		k.mu.Unlock()
		return
	}
	c := k.opts.Clock
	start := c.Now()
	st := Build(k.opts.Input())
	built := c.Now()
	k.mu.Lock()
	k.stats.Builds++
	k.stats.BuildTime += built.Sub(start)
	k.opts.Metrics.built(built.Sub(start))
	same := k.last != nil && equality.Semantic.DeepEqual(*k.last, st)
	k.mu.Unlock()
	if same {
		return
	}
	pctx, cancel := context.WithTimeout(ctx, publishTimeout)
	wrote, err := k.opts.Publisher.Publish(pctx, st)
	cancel()
	k.mu.Lock()
	defer k.mu.Unlock()
	took := c.Since(built)
	k.stats.PublishTime += took
	switch {
	case err != nil:
		k.stats.Failures++
		k.opts.Metrics.published(resultFailed, took)
		k.last = nil
		if ctx.Err() == nil {
			k.opts.Logger.Error(err, "Could not publish the encryption state; retrying at the next check", "interval", k.opts.Interval)
		}
		return
	case wrote:
		k.stats.Writes++
		k.opts.Metrics.published(resultWritten, took)
		k.opts.Logger.V(2).Info("Published the encryption state", "objects", st.Totals.Objects, "plaintext", st.Totals.Plaintext,
			"stale", st.Totals.Stale, "unreadable", st.Totals.Unreadable)
	default:
		k.stats.Unchanged++
		k.opts.Metrics.published(resultUnchanged, took)
	}
	k.last = &st
}
