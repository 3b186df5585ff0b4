package cluster

import (
	"fmt"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/rekey-io/rekey/pkg/coordination"
)

// UnknownMember is a record under <prefix>/members/ that is not a live member of this
// cluster: a leftover without a lease (it would never expire), a record of another
// cluster sharing the etcd and the prefix, or one that does not parse. Nobody knows
// which keys such a record's apiserver can read, if it runs at all, so it holds every
// promotion (the write fence fails closed) but never counts against anyone's readiness
// (a record nobody can vouch for must not take the control plane down). `rekey status`
// lists them with Reason.
type UnknownMember struct {
	// Key is the etcd key of the record.
	Key string `json:"key"`
	// APIServerID is the id the key names.
	APIServerID string `json:"apiserverID"`
	// Reason says why the record is not counted as a member, and what to do.
	Reason string `json:"reason"`
}

// String names the record for a fence's waiting list and for logs.
func (u UnknownMember) String() string { return "unknown member " + u.APIServerID }

// classifyRecord sorts one record under <prefix>/members/ into a member of the cluster
// clusterID or an unknown member. clusterID "" (no identity known, e.g. `rekey status`
// before any apiserver created one) accepts any cluster id.
func classifyRecord(prefix, clusterID string, kv *mvccpb.KeyValue) (MemberState, *UnknownMember) {
	key := string(kv.Key)
	id := strings.TrimPrefix(key, membersPrefix(prefix))
	unknown := func(format string, args ...any) (MemberState, *UnknownMember) {
		return MemberState{}, &UnknownMember{Key: key, APIServerID: id, Reason: fmt.Sprintf(format, args...)}
	}
	m, err := ParseMemberState(kv.Value)
	switch {
	case err != nil:
		return unknown("does not parse as a member state (%v); delete the key if no apiserver of this cluster publishes it", err)
	case m.APIServerID != id:
		return unknown("holds the state of apiserver %q under another apiserver's key; delete the key", m.APIServerID)
	case kv.Lease == 0:
		return unknown("has no lease, so it never expires (a leftover of a restore or a manual write); delete the key")
	case clusterID != "" && m.ClusterID == "":
		return unknown("carries no cluster id (an older rekey, or not written by rekey); upgrade that apiserver, or delete the key")
	case clusterID != "" && m.ClusterID != clusterID:
		return unknown("belongs to cluster %s, not to this cluster %s (%s): another cluster shares this etcd and --coordination-prefix; "+
			"give one of them its own --coordination-prefix", m.ClusterID, clusterID, coordination.Identity(prefix))
	}
	return m, nil
}
