package cluster

import (
	"context"
	"fmt"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
)

// Publisher writes one member's state under a lease that it keeps alive; the key
// disappears when the process dies (the lease expires) or closes (the lease is
// revoked).
type Publisher struct {
	cli *clientv3.Client
	key string
	ttl time.Duration
	log klog.Logger

	mu    sync.Mutex
	lease clientv3.LeaseID
	// lost is signalled when the keep-alive ends (lease expired or revoked): the next
	// Publish grants a new lease.
	lost   chan struct{}
	cancel context.CancelFunc
}

// NewPublisher publishes at key with leases of ttl (whole seconds, at least 2 s).
func NewPublisher(cli *clientv3.Client, key string, ttl time.Duration, log klog.Logger) *Publisher {
	return &Publisher{cli: cli, key: key, ttl: max(ttl, 2*time.Second), log: log, lost: make(chan struct{}, 1)}
}

// Lost is signalled when the lease ended; publish again.
func (p *Publisher) Lost() <-chan struct{} { return p.lost }

// Publish writes st under the lease, granting one first if needed.
func (p *Publisher) Publish(ctx context.Context, st MemberState) error {
	data, err := st.Marshal()
	if err != nil {
		return err
	}
	lease, err := p.ensureLease(ctx)
	if err != nil {
		return err
	}
	if _, err := p.cli.Put(ctx, p.key, string(data), clientv3.WithLease(lease)); err != nil {
		p.mu.Lock()
		if p.lease == lease {
			p.dropLocked() // e.g. the lease expired while etcd was unreachable
		}
		p.mu.Unlock()
		return fmt.Errorf("publishing member state at %s: %w", p.key, err)
	}
	return nil
}

func (p *Publisher) ensureLease(ctx context.Context) (clientv3.LeaseID, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.lease != 0 {
		return p.lease, nil
	}
	g, err := p.cli.Grant(ctx, int64(p.ttl/time.Second))
	if err != nil {
		return 0, fmt.Errorf("granting a %s lease for %s: %w", p.ttl, p.key, err)
	}
	kctx, cancel := context.WithCancel(context.Background())
	ch, err := p.cli.KeepAlive(kctx, g.ID)
	if err != nil {
		cancel()
		return 0, fmt.Errorf("keeping the lease of %s alive: %w", p.key, err)
	}
	p.lease, p.cancel = g.ID, cancel
	go func(id clientv3.LeaseID) {
		for range ch {
		}
		p.mu.Lock()
		if p.lease == id {
			p.dropLocked()
			p.log.Info("Member lease ended; publishing again under a new one", "key", p.key)
			select {
			case p.lost <- struct{}{}:
			default:
			}
		}
		p.mu.Unlock()
	}(g.ID)
	return g.ID, nil
}

func (p *Publisher) dropLocked() {
	if p.cancel != nil {
		p.cancel()
	}
	p.lease, p.cancel = 0, nil
}

// Close revokes the lease, which deletes the member key at once.
func (p *Publisher) Close(ctx context.Context) error {
	p.mu.Lock()
	lease := p.lease
	p.dropLocked()
	p.mu.Unlock()
	if lease == 0 {
		return nil
	}
	_, err := p.cli.Revoke(ctx, lease)
	return err
}
