package cluster

import (
	"context"
	"encoding/json"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/migrate"
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
	// Paused, when set, is the condition holding the migration: etcd's database near
	// its quota or a NOSPACE alarm.
	Paused *migrate.PauseState `json:"paused,omitempty"`
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

// publish writes st when it is due; a lost leadership is ErrNotLeader.
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
// from the revision read; after a compaction or a broken watch it reads again.
func (m *Migrator) follow(ctx context.Context) {
	for ctx.Err() == nil {
		st, rev, err := m.getState(ctx)
		if rev == 0 {
			m.log.V(2).Info("Cannot read the migration state; retrying", "err", err)
			wait(ctx, m.opts.Clock, electionRetry)
			continue
		}
		if err != nil { // read but not decoded: keep the last good one, watch for the next
			m.log.V(2).Info("Ignoring a migration state that does not decode", "err", err)
			st, _ = m.State()
		}
		m.followFrom(ctx, st, rev)
	}
}

// followFrom applies st, read at rev, then every change after rev until the watch
// ends. A follower's inventory refresh that failed is retried on the clock meanwhile.
func (m *Migrator) followFrom(ctx context.Context, st MigrationState, rev int64) {
	wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
	defer cancel()
	changes := m.opts.Client.Watch(wctx, MigrationStateKey(m.opts.Prefix), clientv3.WithRev(rev+1))
	for {
		m.setState(st)
		var retry <-chan time.Time
		if !m.refreshInventory(ctx, st.Records) {
			retry = m.opts.Clock.After(inventoryRetry)
		}
		select {
		case <-ctx.Done():
			return
		case <-retry:
		case resp, ok := <-changes:
			if !ok || resp.Err() != nil {
				m.log.V(2).Info("Migration state watch ended; reading it again", "err", resp.Err())
				return
			}
			st = m.applyEvents(st, resp.Events)
		}
	}
}

// applyEvents returns the state after events; an undecodable one is skipped (logged).
func (m *Migrator) applyEvents(st MigrationState, events []*clientv3.Event) MigrationState {
	for _, ev := range events {
		if ev.Type == mvccpb.DELETE {
			st = MigrationState{}
			continue
		}
		var next MigrationState
		if err := json.Unmarshal(ev.Kv.Value, &next); err != nil {
			m.log.V(2).Info("Ignoring a migration state that does not decode", "key", string(ev.Kv.Key), "err", err)
			continue
		}
		st = next
	}
	return st
}

func (m *Migrator) readState(ctx context.Context) (MigrationState, error) {
	st, _, err := m.getState(ctx)
	return st, err
}

// getState reads the state and the revision it was read at (0 when the read failed);
// no state is the zero one.
func (m *Migrator) getState(ctx context.Context) (MigrationState, int64, error) {
	var st MigrationState
	ctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	resp, err := m.opts.Client.Get(ctx, MigrationStateKey(m.opts.Prefix))
	if err != nil {
		return st, 0, err
	}
	if len(resp.Kvs) == 0 {
		return st, resp.Header.Revision, nil
	}
	err = json.Unmarshal(resp.Kvs[0].Value, &st)
	return st, resp.Header.Revision, err
}
