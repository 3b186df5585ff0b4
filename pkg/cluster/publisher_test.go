package cluster

import (
	"context"
	"errors"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// TestPublisherOpensANewSessionWhenTheLeaseEnds: the member record is the state's JSON
// at the member key under a lease of the configured TTL; when that lease ends (here
// revoked behind the publisher's back), Lost is signalled and the next Publish writes
// the same record under a new lease; Close revokes it, deleting the key.
func TestPublisherOpensANewSessionWhenTheLeaseEnds(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	key := memberKey(defaultPrefix, "a")
	pub := newPublisher(cli, key, time.Second, ktesting.NewLogger(t, ktesting.NewConfig())) // raised to 2 s
	st := MemberState{APIServerID: "a", ConfigHash: "h1"}
	want, err := st.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	record := func() *clientv3.GetResponse {
		t.Helper()
		resp, err := cli.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		return resp
	}

	if _, err := pub.Publish(ctx, st); err != nil {
		t.Fatal(err)
	}
	first := record()
	if len(first.Kvs) != 1 || string(first.Kvs[0].Value) != string(want) || first.Kvs[0].Lease == 0 {
		t.Fatalf("record after the first publish: %+v; want %s under a lease", first.Kvs, want)
	}
	lease := clientv3.LeaseID(first.Kvs[0].Lease)
	ttl, err := cli.TimeToLive(ctx, lease)
	if err != nil || ttl.GrantedTTL != 2 {
		t.Fatalf("lease granted for %d s (%v); want 2", ttl.GrantedTTL, err)
	}

	if _, err := cli.Revoke(ctx, lease); err != nil {
		t.Fatal(err)
	}
	select {
	case <-pub.Lost():
	case <-time.After(20 * time.Second):
		t.Fatal("Lost not signalled after the lease was revoked")
	}
	if n := len(record().Kvs); n != 0 {
		t.Fatalf("%d member records after the lease ended; want none", n)
	}
	if _, err := pub.Publish(ctx, st); err != nil {
		t.Fatal(err)
	}
	second := record()
	if len(second.Kvs) != 1 || string(second.Kvs[0].Value) != string(want) || second.Kvs[0].Lease == 0 || clientv3.LeaseID(second.Kvs[0].Lease) == lease {
		t.Fatalf("record after the lease ended: %+v; want %s under a new lease", second.Kvs, want)
	}

	if err := pub.Close(ctx); err != nil {
		t.Fatal(err)
	}
	if n := len(record().Kvs); n != 0 {
		t.Fatalf("%d member records after Close; want none", n)
	}
}

// TestPublisherGrantBoundedByTheCallersContext: a publish whose context has ended
// opens no session, and the next one opens a lasting session.
func TestPublisherGrantBoundedByTheCallersContext(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	pub := newPublisher(cli, memberKey(defaultPrefix, "a"), 2*time.Second, ktesting.NewLogger(t, ktesting.NewConfig()))
	ended, cancel := context.WithCancel(context.Background())
	cancel()
	if _, err := pub.Publish(ended, MemberState{APIServerID: "a"}); err == nil {
		t.Fatal("a publish with an ended context succeeded")
	}
	pctx, pcancel := context.WithTimeout(context.Background(), etcdTimeout)
	_, err := pub.Publish(pctx, MemberState{APIServerID: "a"})
	pcancel() // the publish's context ends; the session must not
	if err != nil {
		t.Fatal(err)
	}
	pub.mu.Lock()
	s := pub.session
	pub.mu.Unlock()
	// A session living in the publish's context would be cancelled with it, at once.
	if err := s.Ctx().Err(); err != nil {
		t.Fatalf("the session ended with the publish's context: %v", err)
	}
	if err := pub.Close(context.Background()); err != nil {
		t.Fatal(err)
	}
}

// TestPublisherReportsALeaseEtcdRefuses: a publish right after the lease was revoked,
// before the keep-alive can notice, signals Lost (whichever sees the end first) and the
// next publish writes under a new lease; a publish that fails otherwise (etcd did not
// answer in time) keeps the session and its lease.
func TestPublisherReportsALeaseEtcdRefuses(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	pub := newPublisher(cli, memberKey(defaultPrefix, "a"), 10*time.Second, ktesting.NewLogger(t, ktesting.NewConfig()))
	st := MemberState{APIServerID: "a"}
	if _, err := pub.Publish(ctx, st); err != nil {
		t.Fatal(err)
	}
	lease := func() clientv3.LeaseID {
		pub.mu.Lock()
		defer pub.mu.Unlock()
		if pub.session == nil {
			return clientv3.NoLease
		}
		return pub.session.Lease()
	}
	first := lease()

	ended, cancel := context.WithCancel(ctx)
	cancel()
	if _, err := pub.Publish(ended, st); err == nil {
		t.Fatal("a publish with an ended context succeeded")
	}
	if got := lease(); got != first {
		t.Fatalf("after a publish that etcd did not answer the lease is %x; want the session's %x kept", got, first)
	}
	select {
	case <-pub.Lost():
		t.Fatal("Lost signalled for a publish that etcd did not answer")
	default:
	}

	// Revoked through another client, which the publisher's keep-alive learns of only at
	// its next round (every TTL/3, over 3 s here): the Put below meets the revoked lease
	// first. (Revoked through the publisher's own client, the session ended at once in
	// one CI run and the publish succeeded under a new lease.) Either order must end
	// in Lost and a new lease; a failed publish must be etcd's "lease not found".
	if _, err := srv.Client(t).Revoke(ctx, first); err != nil {
		t.Fatal(err)
	}
	if _, err := pub.Publish(ctx, st); err != nil && !errors.Is(err, rpctypes.ErrLeaseNotFound) {
		t.Fatalf("publish under a revoked lease: %v; want %v", err, rpctypes.ErrLeaseNotFound)
	} else if err == nil {
		t.Logf("the keep-alive saw the revoked lease before the publish did")
	}
	select {
	case <-pub.Lost():
	case <-time.After(20 * time.Second):
		t.Fatal("Lost not signalled after the lease was revoked")
	}
	if _, err := pub.Publish(ctx, st); err != nil {
		t.Fatal(err)
	}
	if got := lease(); got == first || got == clientv3.NoLease {
		t.Fatalf("after the lease was lost the record is under %x; want a new lease", got)
	}
	if err := pub.Close(ctx); err != nil {
		t.Fatal(err)
	}
}
