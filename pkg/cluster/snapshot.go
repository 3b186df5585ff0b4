package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// Snapshot is the cluster as etcd holds it at one revision: the live members and the
// migration leader's state (nil when no leader has written one).
type Snapshot struct {
	Members   []MemberState   `json:"members"`
	Migration *MigrationState `json:"migration,omitempty"`
	// Skipped names member keys whose value is not a member state.
	Skipped []string `json:"skipped,omitempty"`
}

// ReadSnapshot reads the member keys and the migration state under prefix.
func ReadSnapshot(ctx context.Context, cli *clientv3.Client, prefix string) (*Snapshot, error) {
	resp, err := cli.Get(ctx, MembersPrefix(prefix), clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the members under %s: %w", MembersPrefix(prefix), err)
	}
	s := &Snapshot{}
	for _, kv := range resp.Kvs {
		m, err := ParseMemberState(kv.Value)
		if err != nil || strings.TrimPrefix(string(kv.Key), MembersPrefix(prefix)) != m.APIServerID {
			s.Skipped = append(s.Skipped, string(kv.Key))
			continue
		}
		s.Members = append(s.Members, m)
	}
	slices.SortFunc(s.Members, func(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
	mresp, err := cli.Get(ctx, MigrationStateKey(prefix), clientv3.WithRev(resp.Header.Revision))
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", MigrationStateKey(prefix), err)
	}
	if len(mresp.Kvs) == 1 {
		var st MigrationState
		if err := json.Unmarshal(mresp.Kvs[0].Value, &st); err != nil {
			return nil, fmt.Errorf("%s is not a migration state: %w", MigrationStateKey(prefix), err)
		}
		s.Migration = &st
	}
	return s, nil
}
