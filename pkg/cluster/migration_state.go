package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// MigrationState is what the migration leader keeps at <prefix>/migration/state: the
// record of every resource's latest migration and the progress of the running one.
type MigrationState struct {
	Leader    string            `json:"leader,omitempty"`
	Records   map[string]Record `json:"records"`
	Running   *Migration        `json:"running,omitempty"`
	Progress  *Progress         `json:"progress,omitempty"`
	Plans     []Plan            `json:"plans,omitempty"`
	UpdatedAt time.Time         `json:"updatedAt"`
}

// Progress is the running migration's progress.
type Progress struct {
	Resource string `json:"resource"`
	Phase    string `json:"phase"`
	Pass     int    `json:"pass"`
	Done     int64  `json:"done"`
	Total    int64  `json:"total"`
	// Rate is objects handled per second so far; ETA the estimated time left.
	Rate float64       `json:"ratePerSecond"`
	ETA  time.Duration `json:"eta"`
	// AllowedRate is what the adaptive pacing allows now (objects/s; 0: no limit).
	AllowedRate float64 `json:"allowedRatePerSecond,omitempty"`
	// SlowedBy says why the pacing slowed the migration down, while it holds it below
	// where it started.
	SlowedBy string `json:"slowedBy,omitempty"`
	// PacedBy are the apiservers whose clients the pacing judges: the leader's own
	// and the followers' that reported theirs (docs/cluster.md).
	PacedBy []string `json:"pacedByClientsOf,omitempty"`
	// Paused, when set, is the condition holding the migration: etcd's database near
	// its quota or a NOSPACE alarm.
	Paused *pace.PauseState `json:"paused,omitempty"`
}

// State publishing: while a migration runs, its progress is written every second;
// otherwise only what changed, and every 30 s (UpdatedAt shows the leader is alive).
const (
	progressInterval = time.Second
	refreshState     = 30 * time.Second
	// inventoryRetry is how soon a follower retries an inventory that failed.
	inventoryRetry = 2 * time.Second
)

// statePublisher writes the leader's MigrationState at its key while guard holds.
type statePublisher struct {
	client      *clientv3.Client
	key         string
	guard       []clientv3.Cmp
	lastBody    string
	lastPublish time.Time
}

// publish writes st when it is due; a lost leadership is errNotLeader.
func (p *statePublisher) publish(st MigrationState, running bool) error {
	now := st.UpdatedAt
	body := st
	body.UpdatedAt = time.Time{}
	content, err := json.Marshal(body)
	if err != nil {
		return err
	}
	since := now.Sub(p.lastPublish)
	if !(running && since >= progressInterval) && string(content) == p.lastBody && since < refreshState {
		return nil
	}
	data, err := json.Marshal(st)
	if err != nil {
		return err
	}
	if err := guardedPut(p.client, p.key, data, p.guard); err != nil {
		return err
	}
	p.lastBody, p.lastPublish = string(content), now
	return nil
}

// follow keeps the state read from etcd current until ctx ends: a read, then a watch
// from the revision read; after a compaction or a broken watch it reads again. While
// the latest read failed or the latest state does not decode, the state is unknown
// (knownState says why) and the guard refuses drops.
func (m *Migrator) follow(ctx context.Context) {
	reporter := &clientsReporter{m: m, parent: ctx}
	defer reporter.set(false)
	for ctx.Err() == nil {
		st, rev, err := m.getState(ctx)
		if rev == 0 {
			m.log.V(2).Info("Cannot read the migration state; retrying", "err", err)
			m.setStateUnknown(err)
			wait(ctx, m.opts.Clock, electionRetry)
			continue
		}
		if err != nil { // read but not decoded: unknown until the next one that decodes
			m.log.V(2).Info("The migration state does not decode; waiting for the next one", "err", err)
			st, _ = m.State()
		}
		m.followFrom(ctx, st, rev, err, reporter)
	}
}

// clientsReporter reports this follower's clients while the state it follows says a
// migration runs (see reportClients).
type clientsReporter struct {
	m      *Migrator
	parent context.Context
	cancel context.CancelFunc
	done   chan struct{}
}

// set starts or stops the reports; outside an apiserver (no serving latency) there is
// nothing to report.
func (r *clientsReporter) set(running bool) {
	serving := r.m.opts.Pacing.Serving
	switch {
	case running && r.cancel == nil && serving != nil:
		// The share starts now: the requests answered from now on are the migration's
		// to judge, and those before make the baseline.
		share := serving.Share()
		ctx, cancel := context.WithCancel(r.parent)
		r.cancel, r.done = cancel, make(chan struct{})
		go func() {
			defer close(r.done)
			reportClients(ctx, r.m.opts.Client, coordination.MigrationClients(r.m.opts.Prefix, r.m.opts.ID), r.m.opts.ID, share, r.m.opts.Clock, r.m.log)
		}()
	case !running && r.cancel != nil:
		r.cancel()
		<-r.done
		r.cancel = nil
	}
}

// followFrom applies st, read at rev (undecodable: why the state at rev is unknown),
// then every change after rev until the watch ends. A follower's inventory refreshes run
// beside it (inventoryRefresher), a failed one retried on the clock.
func (m *Migrator) followFrom(ctx context.Context, st MigrationState, rev int64, undecodable error, reporter *clientsReporter) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	changes := m.opts.Client.Watch(wctx, migrationStateKey(m.opts.Prefix), clientv3.WithRev(rev+1))
	refresher := m.startInventoryRefresher(ctx)
	defer refresher.stop()
	for {
		m.setFollowed(st, undecodable)
		reporter.set(st.Running != nil)
		refresher.want(st.Records)
		select {
		case <-ctx.Done():
			return
		case resp, ok := <-changes:
			if !ok || resp.Err() != nil {
				m.log.V(2).Info("Migration state watch ended; reading it again", "err", resp.Err())
				return
			}
			st, undecodable = m.applyEvents(st, undecodable, resp.Events)
		}
	}
}

// inventoryRefresher runs a follower's inventory refreshes (Migrator.refreshInventory)
// beside its following of the state, on the latest records it was given, retrying a
// failed one after inventoryRetry. Run in the following loop itself, a refresh (every
// object read and decrypted) held up the state changes behind it: a follower busy with
// the inventory after one verified migration saw the next migration start only once
// it was done, and reported none of its clients meanwhile (its reports start with the
// state that says a migration runs).
type inventoryRefresher struct {
	wake   chan struct{}
	cancel context.CancelFunc
	done   chan struct{}

	mu      sync.Mutex
	records map[string]Record
}

func (m *Migrator) startInventoryRefresher(ctx context.Context) *inventoryRefresher {
	ctx, cancel := context.WithCancel(ctx)
	r := &inventoryRefresher{wake: make(chan struct{}, 1), cancel: cancel, done: make(chan struct{})}
	go func() {
		defer close(r.done)
		var retry <-chan time.Time
		for {
			select {
			case <-ctx.Done():
				return
			case <-r.wake:
			case <-retry:
			}
			r.mu.Lock()
			records := r.records
			r.mu.Unlock()
			retry = nil
			if !m.refreshInventory(ctx, records) && ctx.Err() == nil {
				retry = m.opts.Clock.After(inventoryRetry)
			}
		}
	}()
	return r
}

// want makes records the ones to refresh against, and wakes the refresher.
func (r *inventoryRefresher) want(records map[string]Record) {
	r.mu.Lock()
	r.records = records
	r.mu.Unlock()
	select {
	case r.wake <- struct{}{}:
	default:
	}
}

// stop ends the refresher and waits for a refresh under way to return.
func (r *inventoryRefresher) stop() {
	r.cancel()
	<-r.done
}

// applyEvents returns the state after events, and why it is unknown when the latest
// event does not decode (logged; st is then the last state that decoded).
func (m *Migrator) applyEvents(st MigrationState, undecodable error, events []*clientv3.Event) (MigrationState, error) {
	for _, ev := range events {
		if ev.Type == mvccpb.DELETE {
			st, undecodable = MigrationState{}, nil
			continue
		}
		next, err := decodeState(string(ev.Kv.Key), ev.Kv.Value)
		if err != nil {
			m.log.V(2).Info("The migration state does not decode; waiting for the next one", "err", err)
			undecodable = err
			continue
		}
		st, undecodable = next, nil
	}
	return st, undecodable
}

// errStateNotLoaded is knownState's answer before the first read of a follower.
var errStateNotLoaded = errors.New("this apiserver has not loaded it from etcd yet (its migrator is starting, or cannot reach etcd)")

// knownState returns the migration state when it is known: set by the leader, or read
// from etcd and decoded by the follower. Before the first read, while the latest read
// failed and while the latest state does not decode, it returns why instead: nothing
// then says whether a migration runs (callers that guard keys must refuse).
func (m *Migrator) knownState() (MigrationState, error) {
	m.mu.Lock()
	loaded, err := m.loaded, m.stateErr
	m.mu.Unlock()
	switch {
	case err != nil:
		return MigrationState{}, err
	case !loaded:
		return MigrationState{}, errStateNotLoaded
	}
	st, _ := m.State()
	return st, nil
}

// setFollowed sets the state a follower read (undecodable: why the latest one in etcd
// is unknown; st is then the last one that decoded, kept for the status document).
func (m *Migrator) setFollowed(st MigrationState, undecodable error) {
	m.mu.Lock()
	m.state, m.loaded, m.stateErr = st, true, undecodable
	m.mu.Unlock()
}

// setStateUnknown records that the state in etcd cannot be read now (err); the last
// one read stays for the status document.
func (m *Migrator) setStateUnknown(err error) {
	m.mu.Lock()
	m.stateErr = err
	m.mu.Unlock()
}

// getState reads the state and the revision it was read at (0 when the read failed);
// no state is the zero one. A state that does not decode is an error with the
// revision read.
func (m *Migrator) getState(ctx context.Context) (MigrationState, int64, error) {
	return readMigrationStateAt(ctx, m.opts.Client, m.opts.Prefix)
}

// readMigrationStateAt reads the state at prefix (bounded by etcdTimeout) and the
// revision it was read at (0 when the read failed); no state is the zero one. A state
// that does not decode is an error with the revision read.
func readMigrationStateAt(ctx context.Context, cli *clientv3.Client, prefix string) (MigrationState, int64, error) {
	key := migrationStateKey(prefix)
	ctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return MigrationState{}, 0, fmt.Errorf("reading %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return MigrationState{}, resp.Header.Revision, nil
	}
	st, err := decodeState(key, resp.Kvs[0].Value)
	return st, resp.Header.Revision, err
}

// decodeState decodes the state stored at key.
func decodeState(key string, data []byte) (MigrationState, error) {
	var st MigrationState
	if err := json.Unmarshal(data, &st); err != nil {
		return MigrationState{}, fmt.Errorf("%s does not decode: %w (the elected migration leader does not overwrite a state it cannot decode: restore the key, or delete it with etcdctl del to have every resource migrated and verified again)", key, err)
	}
	return st, nil
}
