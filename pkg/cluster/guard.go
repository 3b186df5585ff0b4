package cluster

import (
	"context"
	"fmt"
	"slices"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
)

// Guard is a reload.Options.Guard: it refuses a configuration that drops a key (a
// chain entry current has and next has not, for a resource) while
//   - any live member writes that resource with it (this apiserver included), or
//   - the cluster's migration of that resource is running, or its latest record is not
//     verified, or was verified for the dropped key itself.
//
// Stored objects counted under the key by the local inventory are pkg/guard's
// business; compose the two.
func (n *Node) Guard(current, next *config.Config) error {
	if current == nil || next == nil {
		return nil
	}
	cur, nxt := chainsOf(current), chainsOf(next)
	nextState := MemberState{APIServerID: n.opts.ID}
	nextState.Resources = append(nextState.Resources, nxt...)
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
	for _, r := range cur {
		for _, k := range r.Read {
			if nextState.CanRead(r.Resource, k) {
				continue
			}
			for _, m := range members {
				if rule, _ := m.Rule(r.Resource); rule.Write.SameEntry(k) {
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
				case rec.Target.SameEntry(k):
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

// chainsOf lists, per resource rule of cfg in file order, its chain entries, without
// building anything (a rule named in several entries gets their providers appended,
// as upstream does).
func chainsOf(cfg *config.Config) []ResourceState {
	var out []ResourceState
	index := map[string]int{}
	for _, rc := range cfg.Encryption.Resources {
		var keys []Key
		for _, p := range rc.Providers {
			switch {
			case p.Identity != nil:
				keys = append(keys, Key{Provider: "identity"})
			case p.AESGCM != nil:
				for _, k := range p.AESGCM.Keys {
					keys = append(keys, Key{Provider: "aesgcm", Key: k.Name})
				}
			case p.AESCBC != nil:
				for _, k := range p.AESCBC.Keys {
					keys = append(keys, Key{Provider: "aescbc", Key: k.Name})
				}
			case p.Secretbox != nil:
				for _, k := range p.Secretbox.Keys {
					keys = append(keys, Key{Provider: "secretbox", Key: k.Name})
				}
			case p.KMS != nil:
				keys = append(keys, Key{Provider: "kms", Key: p.KMS.Name})
			}
		}
		for _, r := range rc.Resources {
			name := config.GroupResourceString(schema.ParseGroupResource(r))
			if i, ok := index[name]; ok {
				out[i].Read = append(out[i].Read, keys...)
				continue
			}
			index[name] = len(out)
			rs := ResourceState{Resource: name, Read: slices.Clone(keys)}
			if len(keys) > 0 {
				rs.Write = keys[0]
			}
			out = append(out, rs)
		}
	}
	return out
}
