package cluster

import (
	"context"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2/ktesting"
	"k8s.io/utils/clock"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// TestFollowerClientsReachTheLeader: a follower's clients' requests answered during a
// migration reach the leader's pacer through etcd, with the baseline they made before
// it; the leader ignores a report of its own, and a follower that stops reporting
// takes its report away at once (the lease is revoked).
func TestFollowerClientsReachTheLeader(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	log := ktesting.NewLogger(t, ktesting.NewConfig())
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	leader := watchMemberClients(ctx, cli, defaultPrefix, "a", log)

	t0 := time.Now()
	clk := clocktesting.NewFakePassiveClock(t0)
	serving := pace.NewServingLatency(clk)
	for range 100 {
		serving.Observe(pace.RequestRead, 5*time.Millisecond)
	}
	share := serving.Share()
	clk.SetTime(t0.Add(time.Second))
	rctx, stopReports := context.WithCancel(ctx)
	key := coordination.MigrationClients(defaultPrefix, "b")
	reported := make(chan struct{})
	go func() { defer close(reported); reportClients(rctx, cli, key, "b", share, clock.RealClock{}, log) }()
	// A report under the leader's own id (a stale one of when it followed) is not its clients'.
	if _, err := cli.Put(ctx, coordination.MigrationClients(defaultPrefix, "a"), `{"apiserver":"a","seq":1,"classes":[{"class":"get","baselineMicros":1000,"micros":[900000]}]}`); err != nil {
		t.Fatal(err)
	}

	got := map[string][]time.Duration{}
	baselines := map[string]time.Duration{}
	for i := range 150 {
		serving.Observe(pace.RequestRead, time.Duration(20+i%2)*time.Millisecond)
	}
	eventually(t, "the leader has b's 150 GETs", func() bool {
		leader.DrainMembers(func(member string, c pace.RequestClass, baseline time.Duration, latencies []time.Duration) {
			name := member + " " + c.String()
			baselines[name] = baseline
			got[name] = append(got[name], latencies...)
		})
		return len(got["b get"]) >= 150
	})
	if len(got) != 1 || len(got["b get"]) != 150 || baselines["b get"] != 5*time.Millisecond {
		t.Fatalf("the leader got %d requests of b's GETs (baseline %v), and %d populations in all (%v): want 150 at a 5ms baseline, and b's GETs only",
			len(got["b get"]), baselines["b get"], len(got), baselines)
	}
	for _, d := range got["b get"] {
		if d != 20*time.Millisecond && d != 21*time.Millisecond {
			t.Fatalf("a latency of %v reached the leader, want 20ms or 21ms", d)
		}
	}

	stopReports()
	<-reported
	resp, err := cli.Get(ctx, key, clientv3.WithCountOnly())
	if err != nil {
		t.Fatal(err)
	}
	if resp.Count != 0 {
		t.Fatal("b's report stays after it stopped reporting: its lease was not revoked")
	}
}
