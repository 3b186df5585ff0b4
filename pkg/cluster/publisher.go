package cluster

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/client/v3/concurrency"
	"k8s.io/klog/v2"
)

// publisher writes one member's state under the lease of a concurrency.Session, which
// keeps the lease alive; the key disappears when the process dies (the lease expires)
// or closes (the lease is revoked). What the session does not do is here: the member
// record under its lease, and a new session once the old one is Done.
type publisher struct {
	cli *clientv3.Client
	key string
	ttl time.Duration
	log klog.Logger

	mu      sync.Mutex
	session *memberSession
	// lost is signalled when the session ends (lease expired or revoked): the next
	// Publish opens a new one.
	lost chan struct{}
	// reduced is what the last record left out (MemberState.Reduced), logged when it
	// changes.
	reduced []string
}

// memberSession is a session and the end of the context it lives in.
type memberSession struct {
	*concurrency.Session
	end context.CancelFunc
}

// newPublisher publishes at key with leases of ttl (whole seconds, at least 2 s).
func newPublisher(cli *clientv3.Client, key string, ttl time.Duration, log klog.Logger) *publisher {
	return &publisher{cli: cli, key: key, ttl: max(ttl, 2*time.Second), log: log, lost: make(chan struct{}, 1)}
}

// Lost is signalled when the lease ended; publish again.
func (p *publisher) Lost() <-chan struct{} { return p.lost }

// Publish writes st under the session's lease, opening a session first if needed, and
// returns the revision of the Put.
func (p *publisher) Publish(ctx context.Context, st MemberState) (int64, error) {
	data, sent, err := encodeRecord(st, maxMemberRecordBytes)
	if err != nil {
		return 0, err
	}
	p.noteReduced(sent.Reduced, len(data))
	s, err := p.ensureSession(ctx)
	if err != nil {
		return 0, err
	}
	resp, err := p.cli.Put(ctx, p.key, string(data), clientv3.WithLease(s.Lease()))
	if err != nil {
		if errors.Is(err, rpctypes.ErrLeaseNotFound) {
			// The lease ended (revoked, or expired while etcd was unreachable) and the
			// keep-alive has not noticed yet. Say it is lost here, as awaitEnd would:
			// dropping the session silently would make awaitEnd ignore its end, and the
			// node would publish under a new lease without holding writes first
			// (TestLostLeaseHoldsWrites failed once so: the revoke's own record deletion
			// made the node publish before the keep-alive noticed). Any other failure (an
			// etcd that did not answer) keeps the session: its keep-alive tells whether
			// the lease outlived the outage (reporting it lost on any failure held writes
			// through an etcd member outage).
			p.mu.Lock()
			if p.session == s {
				p.dropLocked()
				p.signalLostLocked()
			}
			p.mu.Unlock()
		}
		return 0, fmt.Errorf("publishing member state at %s: %w", p.key, err)
	}
	return resp.Header.Revision, nil
}

// noteReduced logs when the published record starts or stops being reduced.
func (p *publisher) noteReduced(reduced []string, size int) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if slices.Equal(reduced, p.reduced) {
		return
	}
	p.reduced = reduced
	if len(reduced) > 0 {
		p.log.Info("Member record too large for etcd; publishing it without some error texts", "key", p.key,
			"limit", maxMemberRecordBytes, "bytes", size, "cut", reduced)
	}
}

func (p *publisher) ensureSession(ctx context.Context) (*memberSession, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.session != nil {
		return p.session, nil
	}
	s, err := openSession(ctx, p.cli, p.ttl)
	if err != nil {
		return nil, fmt.Errorf("granting a %s lease for %s: %w", p.ttl, p.key, err)
	}
	p.session = s
	go p.awaitEnd(s)
	return s, nil
}

// openSession opens a session whose lease grant ends with ctx but whose keep-alive
// outlives it: concurrency.WithContext ties both to one context, and a publish is
// bounded by a timeout while its lease must not be.
func openSession(ctx context.Context, cli *clientv3.Client, ttl time.Duration) (*memberSession, error) {
	life, end := context.WithCancel(cli.Ctx())
	detach := context.AfterFunc(ctx, end)
	s, err := concurrency.NewSession(cli, concurrency.WithTTL(int(ttl/time.Second)), concurrency.WithContext(life))
	if !detach() {
		// ctx ended during the grant: its lease, if granted, expires unused.
		if err == nil {
			s.Orphan()
			err = ctx.Err()
		}
		return nil, err
	}
	if err != nil {
		end()
		return nil, err
	}
	return &memberSession{Session: s, end: end}, nil
}

// awaitEnd signals Lost when s ends while it is still the current session.
func (p *publisher) awaitEnd(s *memberSession) {
	<-s.Done()
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.session != s {
		return
	}
	p.dropLocked()
	p.signalLostLocked()
}

// signalLostLocked tells Lost that the lease ended.
func (p *publisher) signalLostLocked() {
	p.log.Info("Member lease ended; publishing again under a new one", "key", p.key)
	select {
	case p.lost <- struct{}{}:
	default:
	}
}

// dropLocked stops the keep-alive without revoking the lease.
func (p *publisher) dropLocked() {
	if p.session != nil {
		p.session.Orphan()
		p.session.end()
	}
	p.session = nil
}

// Close revokes the lease, which deletes the member key at once.
func (p *publisher) Close(ctx context.Context) error {
	p.mu.Lock()
	s := p.session
	p.dropLocked()
	p.mu.Unlock()
	if s == nil {
		return nil
	}
	_, err := p.cli.Revoke(ctx, s.Lease())
	return err
}
