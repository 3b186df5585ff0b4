package cluster

// The clients of every apiserver, for the pacing of a cluster migration. The leader
// alone writes, but every apiserver's watch cache decodes each object it rewrites,
// and a client of any of them may be the one it slows: in a 10,000-Secret rotation
// across three apiservers the leader judged its own GETs within target while a
// sampler reading through all three saw its p99 at ×1.5. So while a migration runs,
// each follower reports what its own clients saw (a pace.ServingShare: their requests
// since its last report, and the baselines they made before the migration) under
// <prefix>/migration/clients/<apiserver-id>, leased, and the leader's pacer judges
// each member's clients against their own baseline (pace.Options.Members).

import (
	"context"
	"encoding/json"
	"errors"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

const (
	// clientsReportInterval is how often a follower reports its clients while a
	// migration runs: a fraction of the pacer's window, so that the leader judges a
	// window on requests at most this much older than its own.
	clientsReportInterval = 250 * time.Millisecond
	// clientsReportTTL is the lease of a report: a follower that died stops counting
	// this long after its last report at most.
	clientsReportTTL = 10 * time.Second
	// maxMemberClientsPending bounds what the leader keeps of one member's class
	// between two drains.
	maxMemberClientsPending = 1 << 14
)

// clientsReport is one report, as stored (JSON). Latencies are in microseconds; Seq
// counts a follower's reports of one migration (for whoever reads them by hand).
type clientsReport struct {
	APIServer string               `json:"apiserver"`
	Seq       uint64               `json:"seq"`
	Classes   []clientsReportClass `json:"classes"`
}

type clientsReportClass struct {
	Class string `json:"class"`
	// BaselineMicros is the class's p99 before the migration (0: too few requests
	// for one).
	BaselineMicros int64   `json:"baselineMicros,omitempty"`
	Micros         []int64 `json:"micros,omitempty"`
}

// reportClients reports share every clientsReportInterval under key, leased, until
// ctx ends; it then revokes the lease, so the report goes at once. A failed write is
// logged and the next report tried: the leader then only judges fewer requests.
func reportClients(ctx context.Context, cli *clientv3.Client, key, id string, share *pace.ServingShare, clk clock.WithTicker, log klog.Logger) {
	defer share.End()
	var lease clientv3.LeaseID
	defer func() {
		if lease != 0 {
			rctx, cancel := context.WithTimeout(context.WithoutCancel(ctx), etcdTimeout)
			_, _ = cli.Revoke(rctx, lease)
			cancel()
		}
	}()
	ticker := clk.NewTicker(clientsReportInterval)
	defer ticker.Stop()
	var seq uint64
	for {
		select {
		case <-ctx.Done():
			return
		case <-ticker.C():
		}
		if lease == 0 {
			var err error
			if lease, err = grantKept(ctx, cli, clientsReportTTL); err != nil {
				log.V(2).Info("Cannot take a lease for this apiserver's clients report; retrying", "err", err)
				continue
			}
		}
		seq++
		r := clientsReport{APIServer: id, Seq: seq}
		share.Take(func(c pace.RequestClass, baseline time.Duration, latencies []time.Duration) {
			rc := clientsReportClass{Class: c.String(), BaselineMicros: baseline.Microseconds(), Micros: make([]int64, len(latencies))}
			for i, d := range latencies {
				rc.Micros[i] = d.Microseconds()
			}
			r.Classes = append(r.Classes, rc)
		})
		value, err := json.Marshal(r)
		if err != nil {
			log.Error(err, "Cannot encode this apiserver's clients report")
			continue
		}
		pctx, cancel := context.WithTimeout(ctx, etcdTimeout)
		_, err = cli.Put(pctx, key, string(value), clientv3.WithLease(lease))
		cancel()
		if err == nil && seq == 1 {
			log.V(2).Info("Reporting this apiserver's clients to the migration leader", "key", key)
		}
		if err != nil && ctx.Err() == nil {
			log.V(2).Info("Cannot write this apiserver's clients report; the next one is tried", "key", key, "err", err)
			if errors.Is(err, rpctypes.ErrLeaseNotFound) {
				lease = 0 // expired while etcd was out of reach: the next report takes a new one
			}
		}
	}
}

// grantKept grants a lease of ttl and keeps it alive until ctx ends.
func grantKept(ctx context.Context, cli *clientv3.Client, ttl time.Duration) (clientv3.LeaseID, error) {
	gctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	g, err := cli.Grant(gctx, int64(ttl/time.Second))
	if err != nil {
		return 0, err
	}
	alive, err := cli.KeepAlive(ctx, g.ID)
	if err != nil {
		return 0, err
	}
	// The keepalive's answers are drained, or it stops renewing.
	go func() {
		for range alive {
		}
	}()
	return g.ID, nil
}

// memberClients is the leader's side: the members' reports, as a migration's
// pace.MembersServing. It watches <prefix>/migration/clients/ from when it starts
// until ctx ends, and keeps each member's requests until the pacer drains them.
type memberClients struct {
	self string
	log  klog.Logger

	mu      sync.Mutex
	pending map[string]*memberPending
}

type memberPending struct {
	baselines map[pace.RequestClass]time.Duration
	latencies map[pace.RequestClass][]time.Duration
}

// watchMemberClients starts watching the reports for a migration led by self; the
// watch ends with ctx.
func watchMemberClients(ctx context.Context, cli *clientv3.Client, prefix, self string, log klog.Logger) *memberClients {
	mc := &memberClients{self: self, log: log, pending: map[string]*memberPending{}}
	dir := coordination.MigrationClients(prefix, "")
	go func() {
		for ctx.Err() == nil {
			// Reports written before the migration started are not this migration's:
			// the watch starts now, and a follower reports only while a migration runs.
			for resp := range cli.Watch(clientv3.WithRequireLeader(ctx), dir, clientv3.WithPrefix()) {
				if resp.Err() != nil {
					break
				}
				for _, ev := range resp.Events {
					if ev.Type == mvccpb.PUT {
						mc.add(ev.Kv.Value)
					}
				}
			}
			wait(ctx, clock.RealClock{}, time.Second)
		}
	}()
	return mc
}

// add takes one report.
func (mc *memberClients) add(value []byte) {
	var r clientsReport
	if err := json.Unmarshal(value, &r); err != nil {
		mc.log.V(2).Info("A member's clients report does not decode; ignored", "err", err)
		return
	}
	if r.APIServer == "" || r.APIServer == mc.self {
		return
	}
	mc.mu.Lock()
	defer mc.mu.Unlock()
	mp := mc.pending[r.APIServer]
	if mp == nil {
		mc.log.V(2).Info("Pacing by another apiserver's clients too", "member", r.APIServer)
		mp = &memberPending{baselines: map[pace.RequestClass]time.Duration{}, latencies: map[pace.RequestClass][]time.Duration{}}
		mc.pending[r.APIServer] = mp
	}
	for _, rc := range r.Classes {
		c, ok := pace.ParseRequestClass(rc.Class)
		if !ok {
			continue // a newer rekey's class
		}
		if rc.BaselineMicros > 0 {
			mp.baselines[c] = time.Duration(rc.BaselineMicros) * time.Microsecond
		}
		ls := mp.latencies[c]
		for _, us := range rc.Micros {
			if len(ls) >= maxMemberClientsPending {
				break
			}
			ls = append(ls, time.Duration(us)*time.Microsecond)
		}
		mp.latencies[c] = ls
	}
}

// DrainMembers implements pace.MembersServing.
func (mc *memberClients) DrainMembers(f func(member string, c pace.RequestClass, baseline time.Duration, latencies []time.Duration)) {
	mc.mu.Lock()
	defer mc.mu.Unlock()
	for member, mp := range mc.pending {
		for c, ls := range mp.latencies {
			// A class without a baseline is dropped: the pacer does not judge it.
			if base := mp.baselines[c]; base > 0 {
				f(member, c, base, ls)
			}
			mp.latencies[c] = ls[:0]
		}
	}
}
