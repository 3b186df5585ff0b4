package keyledger

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// casAttempts bounds how often Update retries after another member wrote first.
const casAttempts = 5

// Store keeps a ledger in etcd at Key.
type Store struct {
	Client *clientv3.Client
	Key    string
}

// Load reads the ledger: an empty one when there is none yet. modRev is its key's
// ModRevision (0 when absent), rev the revision it was read at.
func (s Store) Load(ctx context.Context) (l *Ledger, modRev, rev int64, err error) {
	resp, err := s.Client.Get(ctx, s.Key)
	if err != nil {
		return nil, 0, 0, fmt.Errorf("reading the key ledger %s: %w", s.Key, err)
	}
	l, err = Decode(nil)
	if len(resp.Kvs) > 0 {
		l, err = Decode(resp.Kvs[0].Value)
		modRev = resp.Kvs[0].ModRevision
	}
	if err != nil {
		return nil, 0, 0, fmt.Errorf("the key ledger %s: %w", s.Key, err)
	}
	return l, modRev, resp.Header.Revision, nil
}

// Decode reads a stored ledger; nil data is an empty ledger.
func Decode(data []byte) (*Ledger, error) {
	l := &Ledger{Version: Version}
	if data == nil {
		return l, nil
	}
	if err := json.Unmarshal(data, l); err != nil {
		return nil, fmt.Errorf("does not decode (%v); delete it to start a new ledger", err)
	}
	if l.Version > Version {
		return nil, fmt.Errorf("has format version %d, newer than this rekey's %d; upgrade rekey", l.Version, Version)
	}
	return l, nil
}

// Update applies change to the ledger read at its current revision and writes the
// result with a compare-and-swap on the key's revision, reading again when another
// member wrote first. change returns false when nothing changed: nothing is written.
func (s Store) Update(ctx context.Context, change func(l *Ledger, rev int64) bool) (written bool, err error) {
	for range casAttempts {
		l, modRev, rev, err := s.Load(ctx)
		if err != nil {
			return false, err
		}
		if !change(l, rev) {
			return false, nil
		}
		data, err := json.Marshal(l)
		if err != nil {
			return false, err
		}
		resp, err := s.Client.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(s.Key), "=", modRev)).
			Then(clientv3.OpPut(s.Key, string(data))).
			Commit()
		if err != nil {
			return false, fmt.Errorf("writing the key ledger %s: %w", s.Key, err)
		}
		if resp.Succeeded {
			return true, nil
		}
	}
	return false, fmt.Errorf("writing the key ledger %s: other apiservers wrote it %d times in a row; it is retried at the next record", s.Key, casAttempts)
}

// Recorder is a member's driver of the ledger: Record folds what the member writes
// with (Rules) and its latest inventory into the ledger.
type Recorder struct {
	Store Store
	// Rules are the member's running rules (reload.Agent.Rules).
	Rules func() []transformers.RuleInfo
	// Inventory is the member's latest inventory (migrate.InventoryStore.Latest); nil
	// or returning nil: no retirement is recorded by this member.
	Inventory func() *migrate.Inventory
	// Retention returns the largest --backup-retention the cluster's members publish,
	// and whether every live member published one (Observation.Retention); nil is
	// unknown: every retired entry is kept up to MaxHeldEntries.
	Retention func() (retention time.Duration, known bool)
	// TouchInterval: see Ledger.Observe; zero is DefaultTouchInterval.
	TouchInterval time.Duration
	// Clock reads the time of each observation and paces Run; nil is the real clock.
	Clock  clock.WithTicker
	Logger klog.Logger
	// Wake, when set, makes Run record at once instead of at the next interval (a
	// member that starts writing with a new key: the ledger learns it, and the KMS key
	// id it supersedes, without waiting).
	Wake <-chan struct{}
	// Seen, when set, is handed the ledger as each Record last read and observed it
	// (whether or not it wrote it), for callers that keep a view of it (the KMS v2
	// providers' superseded key ids). It must not keep l's slices beyond the call.
	Seen func(l *Ledger)
}

// Record observes once; it writes only when the ledger changes.
func (r *Recorder) Record(ctx context.Context) (written bool, err error) {
	o := Observation{}
	if r.Rules != nil {
		o.Rules = r.Rules()
	}
	if r.Inventory != nil {
		o.Inventory = r.Inventory()
	}
	if r.Retention != nil {
		o.Retention, o.RetentionKnown = r.Retention()
	}
	c := r.clock()
	var seen *Ledger
	written, err = r.Store.Update(ctx, func(l *Ledger, rev int64) bool {
		changed := l.Observe(o, c.Now(), rev, r.TouchInterval)
		seen = l
		return changed
	})
	if err == nil && seen != nil && r.Seen != nil {
		r.Seen(seen)
	}
	return written, err
}

// Run records every interval until ctx ends; failures are logged (the next record
// catches up: the ledger keeps first and last uses, not every use).
func (r *Recorder) Run(ctx context.Context, interval time.Duration) {
	logger := r.Logger
	if logger.GetSink() == nil {
		logger = klog.Background()
	}
	t := r.clock().NewTicker(interval)
	defer t.Stop()
	for {
		if _, err := r.Record(ctx); err != nil && ctx.Err() == nil {
			logger.Error(err, "Could not record the keys in use in the key ledger; retrying")
		}
		select {
		case <-ctx.Done():
			return
		case <-t.C():
		case <-r.Wake:
		}
	}
}

func (r *Recorder) clock() clock.WithTicker {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}
