package cluster

import (
	"context"
	"fmt"
	"slices"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Guard is a reload.Options.Guard: it refuses a configuration that drops a key (a
// chain entry current has and next has not, for a resource) while
//   - any live member writes that resource with it (this apiserver included, unless no
//     other live member can read its write key: a straggler's catching-up file), or
//   - the cluster's migration of that resource is running, or its latest record is not
//     verified, or was verified for the dropped key itself.
//
// Stored objects counted under the key by the local inventory are pkg/guard's
// business; compose the two.
func (n *Node) Guard(current, next *config.Config) error {
	if current == nil || next == nil {
		return nil
	}
	nextState := configState(n.opts.ID, next)
	members := n.view.Members()
	n.mu.Lock()
	agent, mig := n.agent, n.migrator
	n.mu.Unlock()
	if agent != nil {
		self := StateFromStatus(n.opts.ID, "", agent.OwnStatus(), nil, n.opts.Clock.Now())
		members = append(slices.DeleteFunc(members, func(m MemberState) bool { return m.APIServerID == n.opts.ID }), self)
	}
	var state *MigrationState
	if mig != nil {
		st, _ := mig.State()
		state = &st
	} else if st, err := readMigrationState(n); err == nil {
		state = &st
	}
	var reasons []string
	for _, r := range configState(n.opts.ID, current).Resources {
		for _, k := range r.Read {
			if nextState.CanRead(r.Resource, k) {
				continue
			}
			for _, m := range members {
				if w, ok := m.writes(r.Resource); ok && mayBeSame(w, k) && !ownUnreadWriteKey(m, members, n.opts.ID, r.Resource) {
					reasons = append(reasons, fmt.Sprintf("%s: %s is the write key of apiserver %s", r.Resource, k, m.APIServerID))
				}
			}
			if state == nil {
				continue
			}
			if state.Running != nil && state.Running.Resource == r.Resource {
				reasons = append(reasons, fmt.Sprintf("%s: dropping %s while the migration to %s runs", r.Resource, k, state.Running.Target))
				continue
			}
			if rec, ok := state.Records[r.Resource]; ok {
				switch {
				case !rec.Verified:
					reasons = append(reasons, fmt.Sprintf("%s: dropping %s while the migration to its successor %s is not verified (%s)", r.Resource, k, rec.Target, rec.Error))
				case mayBeSame(rec.Target, k):
					reasons = append(reasons, fmt.Sprintf("%s: %s is the key the last verified migration wrote everything with", r.Resource, k))
				}
			}
		}
	}
	if len(reasons) == 0 {
		return nil
	}
	n.opts.Metrics.guardRefused()
	return &guard.RefusedError{Check: guard.Cluster, Next: guard.ConfigName(next), Reasons: reasons}
}

func readMigrationState(n *Node) (MigrationState, error) {
	m := &Migrator{opts: MigratorOptions{Client: n.opts.Client, Prefix: n.opts.Prefix}}
	return m.readState(context.Background())
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
