package cluster

import (
	"context"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
)

// view is the live member set: a list of <prefix>/members/ followed by a watch from
// the listed revision. A member whose lease expired is deleted by etcd and drops out.
// Records that are not live members of this cluster are kept apart (Unknown).
type view struct {
	cli    *clientv3.Client
	prefix string
	log    klog.Logger

	mu        sync.Mutex
	clusterID string
	members   map[string]MemberState
	// unknown are the records that are not members of this cluster, by apiserver id.
	unknown map[string]UnknownMember
	rev     int64
	loaded  bool
	changed chan struct{} // closed and replaced on every change
}

// newView returns a view of the members under prefix; call Load, then Run.
func newView(cli *clientv3.Client, prefix string, log klog.Logger) *view {
	return &view{cli: cli, prefix: prefix, log: log, members: map[string]MemberState{}, unknown: map[string]UnknownMember{}, changed: make(chan struct{})}
}

// bindCluster makes records of other clusters unknown members; call it before Load.
func (v *view) bindCluster(clusterID string) {
	v.mu.Lock()
	v.clusterID = clusterID
	v.mu.Unlock()
}

// Load lists the members now.
func (v *view) Load(ctx context.Context) error {
	resp, err := v.cli.Get(ctx, MembersPrefix(v.prefix), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	v.mu.Lock()
	defer v.mu.Unlock()
	v.members, v.unknown = map[string]MemberState{}, map[string]UnknownMember{}
	for _, kv := range resp.Kvs {
		v.putLocked(kv)
	}
	v.rev, v.loaded = resp.Header.Revision, true
	v.notifyLocked()
	return nil
}

// putLocked files one record as a member or, logging why, as an unknown member.
func (v *view) putLocked(kv *mvccpb.KeyValue) {
	id := strings.TrimPrefix(string(kv.Key), MembersPrefix(v.prefix))
	m, u := classifyRecord(v.prefix, v.clusterID, kv)
	if u != nil {
		delete(v.members, id)
		if old, seen := v.unknown[id]; !seen || old.Reason != u.Reason {
			v.log.Error(nil, "A record under the members prefix is not a live member of this cluster: it holds promotions of new write keys until it is gone",
				"key", u.Key, "reason", u.Reason)
		}
		v.unknown[id] = *u
		return
	}
	delete(v.unknown, id)
	v.members[id] = m
}

func (v *view) notifyLocked() {
	close(v.changed)
	v.changed = make(chan struct{})
}

// Run watches until ctx ends, listing again after a compaction or a broken watch.
func (v *view) Run(ctx context.Context) {
	for ctx.Err() == nil {
		v.mu.Lock()
		rev := v.rev
		v.mu.Unlock()
		wctx, cancel := context.WithCancel(clientv3.WithRequireLeader(ctx))
		ch := v.cli.Watch(wctx, MembersPrefix(v.prefix), clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
		for resp := range ch {
			if err := resp.Err(); err != nil {
				v.log.V(2).Info("Member watch ended; listing again", "err", err)
				break
			}
			v.mu.Lock()
			for _, ev := range resp.Events {
				if ev.Type == clientv3.EventTypeDelete {
					id := strings.TrimPrefix(string(ev.Kv.Key), MembersPrefix(v.prefix))
					delete(v.members, id)
					delete(v.unknown, id)
					continue
				}
				v.putLocked(ev.Kv)
			}
			v.rev = resp.Header.Revision
			v.notifyLocked()
			v.mu.Unlock()
		}
		cancel()
		for ctx.Err() == nil {
			lctx, lcancel := context.WithTimeout(ctx, 5*time.Second)
			err := v.Load(lctx)
			lcancel()
			if err == nil {
				break
			}
			select {
			case <-ctx.Done():
			case <-time.After(time.Second):
			}
		}
	}
}

// Members returns the live members sorted by id.
func (v *view) Members() []MemberState {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]MemberState, 0, len(v.members))
	for _, m := range v.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
	return out
}

// Unknown returns the records under the members prefix that are not live members of
// this cluster, sorted by key.
func (v *view) Unknown() []UnknownMember {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := slices.Collect(maps.Values(v.unknown))
	slices.SortFunc(out, func(a, b UnknownMember) int { return strings.Compare(a.Key, b.Key) })
	return out
}

// Loaded reports whether a list has succeeded.
func (v *view) Loaded() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.loaded
}

// Changed is closed at the next change of the member set.
func (v *view) Changed() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.changed
}
