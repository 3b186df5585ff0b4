package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Snapshot is the cluster as etcd holds it at one revision: its identity (nil before
// an apiserver created one), the live members, the records that are not (sorted by the
// rules of a Node's member watch: UnknownMember) and the migration leader's state (nil
// when no leader has written one).
type Snapshot struct {
	Identity  *Identity       `json:"identity,omitempty"`
	Members   []MemberState   `json:"members"`
	Migration *MigrationState `json:"migration,omitempty"`
	// UnknownMembers are the records under the members prefix that are not live
	// members of this cluster, with the reason.
	UnknownMembers []UnknownMember `json:"unknownMembers,omitempty"`
}

// ReadSnapshot reads the member keys and the migration state under prefix.
func ReadSnapshot(ctx context.Context, cli *clientv3.Client, prefix string) (*Snapshot, error) {
	resp, err := cli.Get(ctx, membersPrefix(prefix), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the members under %s: %w", membersPrefix(prefix), err)
	}
	id, err := readIdentity(ctx, cli, prefix, resp.Header.Revision)
	if err != nil {
		return nil, err
	}
	s := &Snapshot{Identity: id}
	clusterID := ""
	if id != nil {
		clusterID = id.ClusterID
	}
	for _, kv := range resp.Kvs {
		m, u := classifyRecord(prefix, clusterID, kv)
		if u != nil {
			s.UnknownMembers = append(s.UnknownMembers, *u)
			continue
		}
		s.Members = append(s.Members, m)
	}
	slices.SortFunc(s.Members, func(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
	mresp, err := cli.Get(ctx, migrationStateKey(prefix), clientv3.WithRev(resp.Header.Revision))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", migrationStateKey(prefix), err)
	}
	if len(mresp.Kvs) == 1 {
		var st MigrationState
		if err := json.Unmarshal(mresp.Kvs[0].Value, &st); err != nil {
			return nil, fmt.Errorf("%s is not a migration state: %w", migrationStateKey(prefix), err)
		}
		s.Migration = &st
	}
	return s, nil
}
