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
	"k8s.io/utils/clock"
)

// view is the live member set: a list of <prefix>/members/ followed by a watch from
// the listed revision. A member whose lease expired is deleted by etcd and drops out.
// Records that are not live members of this cluster are kept apart (Unknown).
//
// The view knows the revision it shows and when it last knew that revision current
// (FreshAt: a list, or a watch response). An idle watch delivers nothing, so the view
// asks etcd for a progress notification every progressEvery: a healthy view is never
// older than that, and one older than a lease TTL (etcd unreachable, the process or its
// VM paused) may miss what the others did meanwhile.
type view struct {
	cli    *clientv3.Client
	prefix string
	log    klog.Logger
	clock  clock.WithTicker
	// progressEvery is how often an idle watch is asked to confirm its revision.
	progressEvery time.Duration
	// stepped, when set, is given every list and watch response as the fence's event,
	// on the watch's goroutine, after the view took it (Node.viewStepped).
	stepped func(membersChanged)

	mu        sync.Mutex
	clusterID string
	members   map[string]MemberState
	// unknown are the records that are not members of this cluster, by apiserver id.
	unknown map[string]UnknownMember
	rev     int64
	freshAt time.Time // when rev was last known current
	loaded  bool
	changed chan struct{} // closed and replaced on every change
}

// newView returns a view of the members under prefix, on clk, whose idle watch is
// asked for progress three times per lease TTL, and which hands every list and watch
// response to stepped (nil: nobody); call Load, then Run.
func newView(cli *clientv3.Client, prefix string, log klog.Logger, clk clock.WithTicker, ttl time.Duration, stepped func(membersChanged)) *view {
	return &view{cli: cli, prefix: prefix, log: log, clock: clk, progressEvery: max(ttl/3, 100*time.Millisecond), stepped: stepped,
		members: map[string]MemberState{}, unknown: map[string]UnknownMember{}, changed: make(chan struct{})}
}

// bindCluster makes records of other clusters unknown members; call it before Load.
func (v *view) bindCluster(clusterID string) {
	v.mu.Lock()
	v.clusterID = clusterID
	v.mu.Unlock()
}

// Load lists the members now.
func (v *view) Load(ctx context.Context) error {
	resp, err := v.cli.Get(ctx, membersPrefix(v.prefix), clientv3.WithPrefix())
	if err != nil {
		return err
	}
	v.mu.Lock()
	v.members, v.unknown = map[string]MemberState{}, map[string]UnknownMember{}
	for _, kv := range resp.Kvs {
		v.putLocked(kv)
	}
	v.rev, v.loaded, v.freshAt = resp.Header.Revision, true, v.clock.Now()
	ev := v.eventLocked()
	v.mu.Unlock()
	v.step(ev, true)
	return nil
}

// eventLocked is what the view shows, as the fence's event: the live members of this
// cluster and the unknown records apart, at the view's revision.
func (v *view) eventLocked() membersChanged {
	return membersChanged{Members: v.membersLocked(), Unknown: v.unknownLocked(), Rev: v.rev}
}

// step hands ev to the callback, outside v.mu (the callback takes the node's lock,
// which is held while the view is read elsewhere), and then, for a change, wakes the
// waiters on Changed: whoever wakes finds the fence already fed.
func (v *view) step(ev membersChanged, changed bool) {
	if v.stepped != nil {
		v.stepped(ev)
	}
	if changed {
		v.mu.Lock()
		v.notifyLocked()
		v.mu.Unlock()
	}
}

// putLocked files one record as a member or, logging why, as an unknown member.
func (v *view) putLocked(kv *mvccpb.KeyValue) {
	id := strings.TrimPrefix(string(kv.Key), membersPrefix(v.prefix))
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
		ch := v.cli.Watch(wctx, membersPrefix(v.prefix), clientv3.WithPrefix(), clientv3.WithRev(rev+1), clientv3.WithPrevKV())
		v.follow(wctx, ch)
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
			case <-v.clock.After(time.Second):
			}
		}
	}
}

// follow applies the watch's responses until it ends, asking for a progress
// notification every progressEvery (on the watch's own stream: the same context
// metadata). A response confirms the view current at its revision; only one with
// events is a change.
func (v *view) follow(wctx context.Context, ch clientv3.WatchChan) {
	progress := v.clock.NewTicker(v.progressEvery)
	defer progress.Stop()
	for {
		select {
		case <-progress.C():
			if err := v.cli.RequestProgress(wctx); err != nil && wctx.Err() == nil {
				v.log.V(2).Info("Cannot ask the member watch for progress", "err", err)
			}
		case resp, ok := <-ch:
			if !ok {
				return
			}
			if err := resp.Err(); err != nil {
				v.log.V(2).Info("Member watch ended; listing again", "err", err)
				return
			}
			v.apply(resp)
		}
	}
}

// apply files one watch response and hands the view to the callback: one with events
// is a change, a progress notification moves the revision on (which can end a
// resynchronisation, fence_resync.go).
func (v *view) apply(resp clientv3.WatchResponse) {
	v.mu.Lock()
	for _, ev := range resp.Events {
		if ev.Type == clientv3.EventTypeDelete {
			id := strings.TrimPrefix(string(ev.Kv.Key), membersPrefix(v.prefix))
			delete(v.members, id)
			delete(v.unknown, id)
			continue
		}
		v.putLocked(ev.Kv)
	}
	v.rev, v.freshAt = max(v.rev, resp.Header.Revision), v.clock.Now()
	ev := v.eventLocked()
	v.mu.Unlock()
	v.step(ev, len(resp.Events) > 0)
}

// FreshAt is when the view was last known current (zero before the first list).
func (v *view) FreshAt() time.Time {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.freshAt
}

// Members returns the live members sorted by id.
func (v *view) Members() []MemberState {
	v.mu.Lock()
	defer v.mu.Unlock()
	return v.membersLocked()
}

func (v *view) membersLocked() []MemberState {
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
	return v.unknownLocked()
}

func (v *view) unknownLocked() []UnknownMember {
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
