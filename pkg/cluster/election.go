package cluster

import (
	"context"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// electionRetry is the pause before a new session or campaign after a failed one.
const electionRetry = time.Second

// elector campaigns on one key with concurrency.Election, in the shape of client-go's
// leaderelection: the loop only wins and loses; what a leader does, and what the
// others do meanwhile, are callbacks.
type elector struct {
	client *clientv3.Client
	key    string
	id     string
	ttl    time.Duration
	clock  clock.Clock
	log    klog.Logger
}

// electionCallbacks is what runs on either side of the election.
type electionCallbacks struct {
	// OnStartedLeading runs while this apiserver leads. guard holds while it still owns
	// the leader key; ctx is cancelled when the session ends. Returning ends the term
	// (e.g. a guarded write found the leadership gone).
	OnStartedLeading func(ctx context.Context, guard []clientv3.Cmp)
	// WhileFollowing runs during each campaign; ctx ends when it is won or abandoned.
	WhileFollowing func(ctx context.Context)
}

// Run campaigns, and leads when elected, until ctx ends.
func (e *elector) Run(ctx context.Context, cb electionCallbacks) {
	for ctx.Err() == nil {
		session, err := concurrency.NewSession(e.client, concurrency.WithTTL(int(e.ttl/time.Second)), concurrency.WithContext(ctx))
		if err != nil {
			e.log.Error(err, "Cannot open an election session; retrying")
			wait(ctx, e.clock, electionRetry)
			continue
		}
		if el := e.campaign(ctx, session, cb.WhileFollowing); el != nil {
			e.lead(ctx, session, el, cb.OnStartedLeading)
		}
		// Revoke the session's lease with a context of its own (ctx may be cancelled
		// already): a successor is elected at once instead of after the TTL.
		rctx, cancel := context.WithTimeout(context.Background(), etcdTimeout)
		_, _ = e.client.Revoke(rctx, session.Lease())
		cancel()
		session.Orphan()
	}
}

// campaign waits to be elected, running follow meanwhile; it returns the won
// election, or nil.
func (e *elector) campaign(ctx context.Context, session *concurrency.Session, follow func(context.Context)) *concurrency.Election {
	el := concurrency.NewElection(session, e.key)
	campaignCtx, stop := context.WithCancel(ctx)
	followed := make(chan struct{})
	go func() { defer close(followed); follow(campaignCtx) }()
	err := el.Campaign(campaignCtx, e.id)
	stop()
	<-followed
	if err == nil {
		return el
	}
	if ctx.Err() == nil {
		e.log.Error(err, "Campaign for migration leader failed; retrying")
		wait(ctx, e.clock, electionRetry)
	}
	return nil
}

// lead runs onStarted with a context that ends with the session.
func (e *elector) lead(ctx context.Context, session *concurrency.Session, el *concurrency.Election, onStarted func(context.Context, []clientv3.Cmp)) {
	guard := []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(el.Key()), "=", el.Rev())}
	termCtx, cancel := context.WithCancel(ctx)
	defer cancel()
	stop := context.AfterFunc(session.Ctx(), func() {
		if ctx.Err() == nil {
			e.log.Info("Migration leader session ended; stopping the running migration", "apiserverID", e.id)
		}
		cancel()
	})
	defer stop()
	onStarted(termCtx, guard)
}

// wait waits d on clk or until ctx ends.
func wait(ctx context.Context, clk clock.Clock, d time.Duration) {
	t := clk.NewTimer(d)
	defer t.Stop()
	select {
	case <-ctx.Done():
	case <-t.C():
	}
}
