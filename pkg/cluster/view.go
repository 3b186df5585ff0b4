package cluster

import (
	"context"
	"slices"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
)

// View is the live member set: a list of <prefix>/members/ followed by a watch from
// the listed revision. A member whose lease expired is deleted by etcd and drops out.
type View struct {
	cli    *clientv3.Client
	prefix string
	log    klog.Logger

	mu      sync.Mutex
	members map[string]MemberState
	rev     int64
	loaded  bool
	changed chan struct{} // closed and replaced on every change
}

// NewView returns a view of the members under prefix; call Load, then Run.
func NewView(cli *clientv3.Client, prefix string, log klog.Logger) *View {
	return &View{cli: cli, prefix: prefix, log: log, members: map[string]MemberState{}, changed: make(chan struct{})}
}

// Load lists the members now.
func (v *View) Load(ctx context.Context) error {
	resp, err := v.cli.Get(ctx, MembersPrefix(v.prefix), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	members := map[string]MemberState{}
	for _, kv := range resp.Kvs {
		if m, ok := v.parse(kv.Key, kv.Value); ok {
			members[m.APIServerID] = m
		}
	}
	v.mu.Lock()
	v.members, v.rev, v.loaded = members, resp.Header.Revision, true
	v.notifyLocked()
	v.mu.Unlock()
	return nil
}

func (v *View) parse(key, value []byte) (MemberState, bool) {
	m, err := ParseMemberState(value)
	if err != nil {
		v.log.Error(err, "Ignoring a member key that does not hold a member state", "key", string(key))
		return m, false
	}
	if id := strings.TrimPrefix(string(key), MembersPrefix(v.prefix)); id != m.APIServerID {
		v.log.Error(nil, "Ignoring a member state published under another apiserver's key", "key", string(key), "apiserverID", m.APIServerID)
		return m, false
	}
	return m, true
}

func (v *View) notifyLocked() {
	close(v.changed)
	v.changed = make(chan struct{})
}

// Run watches until ctx ends, listing again after a compaction or a broken watch.
func (v *View) Run(ctx context.Context) {
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
				id := strings.TrimPrefix(string(ev.Kv.Key), MembersPrefix(v.prefix))
				if ev.Type == clientv3.EventTypeDelete {
					delete(v.members, id)
					continue
				}
				if m, ok := v.parse(ev.Kv.Key, ev.Kv.Value); ok {
					v.members[id] = m
				}
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
func (v *View) Members() []MemberState {
	v.mu.Lock()
	defer v.mu.Unlock()
	out := make([]MemberState, 0, len(v.members))
	for _, m := range v.members {
		out = append(out, m)
	}
	slices.SortFunc(out, func(a, b MemberState) int { return strings.Compare(a.APIServerID, b.APIServerID) })
	return out
}

// Loaded reports whether a list has succeeded.
func (v *View) Loaded() bool {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.loaded
}

// Changed is closed at the next change of the member set.
func (v *View) Changed() <-chan struct{} {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.changed
}
