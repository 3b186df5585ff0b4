package cluster

import (
	"context"
	"fmt"
	"maps"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Guard is a reload.Options.Guard: it refuses a configuration that drops a key (a
// chain entry current has and next has not, for a resource) while
//   - any live member writes that resource with it (this apiserver included, unless no
//     other live member can read its write key: a straggler's catching-up file),
//   - any other live member has it configured as its write key, held back or not, or
//   - the cluster's migration of that resource is running, or its latest record is not
//     verified, or was verified for the dropped key itself.
//
// A drop that passes the checks against the watched members is first announced: this
// apiserver publishes its record with the dropped keys removed (withoutKeys), reads
// every member record again with a linearizable read, and checks again; only then does
// the reload go on to swap. The announcement stays published until the reload
// concludes (swapped, or failed after the guard), and after a refusal because another
// member holds a dropped key back, until the next attempt: that member's fence never
// promotes onto a key this file drops, and when every file drops it, every guard lets
// it go.
//
// The guard fails closed: a migration state it cannot read (etcd does not answer, the
// stored state does not decode, a follower has not loaded it yet) says nothing about
// whether a migration still needs a dropped key, so the drop is refused and the reload
// retried.
//
// Stored objects counted under the key by the local inventory are pkg/guard's
// business; compose the two.
func (n *Node) Guard(current, next *config.Config) error {
	ctx, cancel := context.WithTimeout(context.Background(), 2*etcdTimeout)
	defer cancel()
	return n.guard(ctx, current, next)
}

// guard is Guard with the context of its etcd reads.
func (n *Node) guard(ctx context.Context, current, next *config.Config) error {
	if current == nil || next == nil {
		return nil
	}
	cur, nxt := configState(n.opts.ID, current), configState(n.opts.ID, next)
	check := checkDrops(n.opts.ID, cur, nxt, n.membersWithSelf(n.view.Members()))
	reasons := slices.Clone(check.InUse)
	if migReasons, err := n.migrationReasons(ctx, check.Drops); err != nil {
		reasons = append(reasons, fmt.Sprintf("%s: %v", migrationStateUnknown, err))
	} else {
		reasons = append(reasons, migReasons...)
	}
	if len(reasons) > 0 || len(check.Drops) == 0 {
		n.setDropPlan(nil)
		return n.refuse(next, append(reasons, check.Configured...))
	}
	// Announce, then look again at a revision after the announcement.
	n.setDropPlan(&dropPlan{configHash: next.Hash, drops: check.Drops, at: n.opts.Clock.Now()})
	if err := n.publishNow(ctx, true); err != nil {
		n.setDropPlan(nil)
		return n.refuse(next, []string{fmt.Sprintf("cannot announce the keys it drops to the other apiservers (%v); retrying", err)})
	}
	read, err := readMembers(ctx, n.opts.Client, n.opts.Prefix, n.ownClusterID())
	if err != nil {
		n.setDropPlan(nil)
		n.Notify()
		return n.refuse(next, []string{fmt.Sprintf("cannot read the other apiservers' state after announcing the keys it drops (%v); retrying", err)})
	}
	check = checkDrops(n.opts.ID, cur, nxt, n.membersWithSelf(read.Members))
	if len(check.InUse) > 0 {
		n.setDropPlan(nil)
		n.Notify()
	}
	return n.refuse(next, check.Reasons())
}

// refuse returns the cluster guard's refusal for reasons (nil when there are none).
func (n *Node) refuse(next *config.Config, reasons []string) error {
	if len(reasons) == 0 {
		return nil
	}
	return &guard.RefusedError{Check: guard.Cluster, Next: guard.ConfigName(next), Reasons: reasons}
}

// membersWithSelf replaces this apiserver's record in members with its state as it
// serves now.
func (n *Node) membersWithSelf(members []MemberState) []MemberState {
	n.mu.Lock()
	agent := n.agent
	n.mu.Unlock()
	if agent == nil {
		return members
	}
	self := stateFromStatus(n.opts.ID, "", agent.OwnStatus(), nil, n.opts.Clock.Now())
	return append(slices.DeleteFunc(slices.Clone(members), func(m MemberState) bool { return m.APIServerID == n.opts.ID }), self)
}

// migrationStateUnknown opens the guard's refusal when the migration state is unknown.
const migrationStateUnknown = "cannot read the cluster's migration state; retrying"

// migrationReasons says why the cluster's migration still needs a dropped key; err is
// why the migration state is unknown (the guard then refuses every drop).
func (n *Node) migrationReasons(ctx context.Context, drops map[string][]Key) ([]string, error) {
	if len(drops) == 0 {
		return nil, nil
	}
	state, err := n.migrationState(ctx)
	if err != nil {
		return nil, err
	}
	var reasons []string
	for _, res := range slices.Sorted(maps.Keys(drops)) {
		for _, k := range drops[res] {
			if state.Running != nil && state.Running.Resource == res {
				reasons = append(reasons, fmt.Sprintf("%s: dropping %s while the migration to %s runs", res, k, state.Running.Target))
				continue
			}
			if rec, ok := state.Records[res]; ok {
				switch {
				case !rec.Verified:
					reasons = append(reasons, fmt.Sprintf("%s: dropping %s while the migration to its successor %s is not verified (%s)", res, k, rec.Target, rec.Error))
				case mayBeSame(rec.Target, k):
					reasons = append(reasons, fmt.Sprintf("%s: %s is the key the last verified migration wrote everything with", res, k))
				}
			}
		}
	}
	return reasons, nil
}

// migrationState is the cluster's migration state as the guard needs it: the
// migrator's when this apiserver runs one (the leader's own; a follower's as read and
// decoded from etcd, unknown before its first read), else a linearizable read of it.
func (n *Node) migrationState(ctx context.Context) (MigrationState, error) {
	n.mu.Lock()
	mig := n.migrator
	n.mu.Unlock()
	if mig != nil {
		return mig.knownState()
	}
	st, _, err := readMigrationStateAt(ctx, n.opts.Client, n.opts.Prefix)
	return st, err
}

// dropPlan is a drop this apiserver announced: the configuration that drops them and
// when the guard let it through (or refused it because another member holds one back).
type dropPlan struct {
	configHash string
	drops      map[string][]Key
	at         time.Time
}

// setDropPlan replaces the announced drop (nil: none).
func (n *Node) setDropPlan(p *dropPlan) {
	n.mu.Lock()
	n.dropping = p
	n.mu.Unlock()
}

// announced applies the announced drop to st, this apiserver's state from its agent's
// status st, and forgets it once the reload concluded: the configuration that drops the
// keys serves (its own rules no longer have them), or a later attempt was made.
func (n *Node) announced(st MemberState, active string, lastAttempt, lastError time.Time) MemberState {
	n.mu.Lock()
	p := n.dropping
	if p != nil && (active == p.configHash || lastAttempt.After(p.at) && !lastError.After(lastAttempt)) {
		n.dropping, p = nil, nil
	}
	n.mu.Unlock()
	if p == nil {
		return st
	}
	return withoutKeys(st, p.drops)
}

// readMembers reads every member record under prefix with one linearizable Get (etcd's
// default). Keys that do not hold the member state of the apiserver they name are left
// out, as the view leaves them out.
func readMembers(ctx context.Context, cli *clientv3.Client, prefix, clusterID string) (membersRead, error) {
	resp, err := cli.Get(ctx, membersPrefix(prefix), clientv3.WithPrefix())
	if err != nil {
		return membersRead{}, fmt.Errorf("reading the members under %s: %w", membersPrefix(prefix), err)
	}
	var r membersRead
	for _, kv := range resp.Kvs {
		// The same sorting as the view's: a leftover or another cluster's record is no
		// member whose keys a drop or a promotion must wait for.
		if m, unknown := classifyRecord(prefix, clusterID, kv); unknown == nil {
			r.Members = append(r.Members, m)
		}
	}
	return r, nil
}

// mayBeSame reports whether nothing proves a and b different keys (the guard fails
// closed: a record without a check value may be the key dropped).
func mayBeSame(a, b Key) bool {
	m := a.Match(b)
	return m == transformers.KeysSame || m == transformers.KeysUnverified
}

// ownUnreadWriteKey reports whether m is this apiserver and no other live member may
// read its write key for resource: then that key never makes it refuse a file (a
// straggler's catching-up file drops the key only it writes with). Objects it stored
// under the key are the stored-objects guard's business.
func ownUnreadWriteKey(m MemberState, members []MemberState, self, resource string) bool {
	if m.APIServerID != self {
		return false
	}
	w, _ := m.writes(resource)
	return !slices.ContainsFunc(members, func(o MemberState) bool { return o.APIServerID != self && o.mayRead(resource, w) })
}
