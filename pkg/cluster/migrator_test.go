package cluster

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"slices"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

func startMigrator(t *testing.T, ctx context.Context, cli *clientv3.Client, m *member, store *migrate.InventoryStore, rate ...float64) (*Migrator, chan struct{}) {
	t.Helper()
	mig, _, done := startProbedMigrator(t, ctx, cli, m, store, rate...)
	return mig, done
}

// startProbedMigrator also returns a probe of the leader's rounds.
func startProbedMigrator(t *testing.T, ctx context.Context, cli *clientv3.Client, m *member, store *migrate.InventoryStore, rate ...float64) (*Migrator, *roundProbe, chan struct{}) {
	t.Helper()
	return startPacedMigrator(t, ctx, cli, m, store, pace.Options{}, rate...)
}

// startPacedMigrator also sets the pacing options.
func startPacedMigrator(t *testing.T, ctx context.Context, cli *clientv3.Client, m *member, store *migrate.InventoryStore, pacing pace.Options, rate ...float64) (*Migrator, *roundProbe, chan struct{}) {
	t.Helper()
	return startMigratorWith(t, ctx, cli, m, MigratorOptions{Pacing: pacing, Rate: append(rate, 0)[0], Inventory: store})
}

// startMigratorWith starts m's migrator with opts, its client, identity, resources,
// source and members filled in.
func startMigratorWith(t *testing.T, ctx context.Context, cli *clientv3.Client, m *member, opts MigratorOptions) (*Migrator, *roundProbe, chan struct{}) {
	t.Helper()
	probe := &roundProbe{}
	opts.Client, opts.Prefix, opts.ID, opts.SessionTTL = cli, defaultPrefix, m.id, 10*time.Second // a stop revokes it; 10 s outlives a starved keep-alive
	opts.Resources = []migrate.Resource{migrate.ResourceFor("/registry", secrets)}
	opts.Source = migrate.FromRules(m.agent, m.agent.Rules)
	opts.Members, opts.MembersChanged = probe.wrap(m.node.view.Members), m.node.view.Changed
	opts.Logger = m.node.log
	mig := NewMigrator(opts)
	m.node.SetMigrator(mig)
	done := make(chan struct{})
	go func() { defer close(done); mig.Run(ctx) }()
	return mig, probe, done
}

// roundProbe counts the leader's rounds: each reads the members once, at its start, and
// decides on them (starts a migration, publishes the state) before the next begins.
type roundProbe struct {
	mu     sync.Mutex
	rounds int
	last   []MemberState
}

func (p *roundProbe) wrap(members func() []MemberState) func() []MemberState {
	return func() []MemberState {
		ms := members()
		p.mu.Lock()
		p.rounds, p.last = p.rounds+1, ms
		p.mu.Unlock()
		return ms
	}
}

// decidedOn returns a condition that holds once a round that read members satisfying
// cond has finished (the next round has begun): whatever the leader would do on those
// members, it has done.
func (p *roundProbe) decidedOn(cond func([]MemberState) bool) func() bool {
	seenAt := 0
	return func() bool {
		p.mu.Lock()
		defer p.mu.Unlock()
		if seenAt == 0 {
			if cond(p.last) {
				seenAt = p.rounds
			}
			return false
		}
		return p.rounds > seenAt
	}
}

// TestMigratorMigratesOnceAllWriteTheSameKeyAndFailsOver: the elected leader migrates
// stored secrets only after both members write k2, records the target verified, and a
// second migrator takes over when the leader stops.
func TestMigratorMigratesOnceAllWriteTheSameKeyAndFailsOver(t *testing.T) {
	cli, a, b := startPair(t)
	ctx := context.Background()
	storeSecrets(t, cli, a, 40, "/registry/secrets/ns/s%02d")
	actx, acancel := context.WithCancel(ctx)
	defer acancel()
	migA, roundsA, doneA := startProbedMigrator(t, actx, cli, a, nil)
	eventually(t, "a leads", func() bool { _, l := migA.State(); return l })
	bctx, bcancel := context.WithCancel(ctx)
	defer func() { bcancel() }()
	storeB := &migrate.InventoryStore{}
	migB, doneB := startMigrator(t, bctx, cli, b, storeB)
	eventually(t, "a records k1 verified", func() bool {
		st, _ := migA.State()
		return st.Records["secrets"].Verified && st.Records["secrets"].Target.Key == "k1"
	})

	// a gets k2 first: held; nothing may be migrated to k2.
	writeFile(t, a.path, secretsConfig("k2", "k1"))
	if err := a.agent.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	// The point where a migration to k2 would start: the leader has decided on a's
	// record reading k2.
	eventually(t, "the leader decided on a's record reading k2", roundsA.decidedOn(func(ms []MemberState) bool {
		for _, m := range ms {
			if rule, ok := m.Rule("secrets"); ok && m.APIServerID == "a" && slices.ContainsFunc(rule.Read, func(k Key) bool { return k.Key == "k2" }) {
				return true
			}
		}
		return false
	}))
	if st, _ := migA.State(); st.Running != nil || st.Records["secrets"].Target.Key != "k1" {
		t.Fatalf("the leader migrates before b can read k2: running %+v, records %+v", st.Running, st.Records)
	}
	if n := countPrefix(t, cli, "k8s:enc:aesgcm:v1:k2:"); n != 0 {
		t.Fatalf("%d objects on k2 before b can read it", n)
	}
	writeFile(t, b.path, secretsConfig("k2", "k1"))
	if err := b.agent.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	eventually(t, "every object on k2, verified", func() bool {
		st, _ := migA.State()
		return st.Records["secrets"].Verified && st.Records["secrets"].Target.Key == "k2" && countPrefix(t, cli, "k8s:enc:aesgcm:v1:k2:") == 40
	})
	// b follows the state in etcd (watched).
	eventually(t, "b follows a's state", func() bool {
		st, _ := migB.State()
		return st.Leader == "a" && st.Records["secrets"].Verified && st.Records["secrets"].Target.Key == "k2"
	})
	// The follower's inventory is refreshed after the verified migration: its guard and
	// readiness stop counting objects under k1.
	eventually(t, "b's inventory shows every object on k2", func() bool {
		ri := storeB.Latest().Find("secrets")
		if ri == nil {
			return false
		}
		for _, c := range ri.Buckets {
			if c.Objects > 0 && c.Key != "k2" {
				return false
			}
		}
		return ri.Objects == 40
	})

	// The leader stops: b is elected and takes the records over.
	acancel()
	<-doneA
	eventually(t, "b leads", func() bool { _, l := migB.State(); return l })
	st, _ := migB.State()
	if r := st.Records["secrets"]; !r.Verified || r.Target.Key != "k2" {
		t.Fatalf("b's records after failover: %+v", st.Records)
	}
	bcancel()
	<-doneB
}

func countPrefix(t *testing.T, cli *clientv3.Client, prefix string) int {
	t.Helper()
	resp, err := cli.Get(context.Background(), "/registry/secrets/", clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, kv := range resp.Kvs {
		if bytes.HasPrefix(kv.Value, []byte(prefix)) {
			n++
		}
	}
	return n
}

// holdLeaderKey puts a leader key, as a won election would, and returns it with the
// guard that holds while it stays (deleting it stands for a lost leadership).
func holdLeaderKey(t *testing.T, cli *clientv3.Client) (string, []clientv3.Cmp) {
	t.Helper()
	lk := coordination.MigrationLeader(defaultPrefix) + "/x"
	put, err := cli.Put(context.Background(), lk, "a")
	if err != nil {
		t.Fatal(err)
	}
	return lk, []clientv3.Cmp{clientv3.Compare(clientv3.CreateRevision(lk), "=", put.Header.Revision)}
}

// TestEtcdCheckpointsGuardedByLeadership: the checkpoint round-trips through etcd, and
// a store whose guard no longer holds (a deposed leader) cannot overwrite it.
func TestEtcdCheckpointsGuardedByLeadership(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	lk, guard := holdLeaderKey(t, cli)
	store := &etcdCheckpoints{Client: cli, Key: coordination.MigrationCheckpoint(defaultPrefix), Guard: guard}
	if c, err := store.Load(context.Background()); c != nil || err != nil {
		t.Fatalf("empty store: %v %v", c, err)
	}
	want := &migrate.Checkpoint{Resource: "secrets", LastKey: "/registry/secrets/ns/s10", Done: []string{"configmaps"}}
	if err := store.Save(want); err != nil {
		t.Fatal(err)
	}
	got, err := store.Load(context.Background())
	if err != nil || got.LastKey != want.LastKey || got.Resource != "secrets" || len(got.Done) != 1 {
		t.Fatalf("loaded %+v, %v", got, err)
	}
	if _, err := cli.Delete(ctx, lk); err != nil { // leadership lost
		t.Fatal(err)
	}
	if err := store.Save(&migrate.Checkpoint{LastKey: "/registry/secrets/ns/s99"}); !errors.Is(err, errNotLeader) {
		t.Fatalf("save after losing leadership = %v, want errNotLeader", err)
	}
	if got, _ := store.Load(context.Background()); got.LastKey != want.LastKey {
		t.Fatalf("a deposed leader overwrote the checkpoint: %+v", got)
	}
	if _, err := cli.Put(ctx, store.Key, "{not json"); err != nil {
		t.Fatal(err)
	}
	if _, err := store.Load(context.Background()); err == nil {
		t.Fatal("a corrupt checkpoint loaded without error")
	}
}

// TestLeaderKilledMidMigrationAnotherResumes: the leader stops in the middle of a
// (rate-limited) migration; the other apiserver is elected, resumes from the checkpoint
// in etcd, and finishes: every object on the new key, none lost.
func TestLeaderKilledMidMigrationAnotherResumes(t *testing.T) {
	cli, a, b := startPair(t)
	ctx := context.Background()
	const n = 120
	storeSecrets(t, cli, a, n, "/registry/secrets/ns/s%03d")
	for _, m := range []*member{a, b} {
		writeFile(t, m.path, secretsConfig("k2", "k1"))
		if err := m.agent.Reload(ctx); err != nil {
			t.Fatal(err)
		}
	}
	eventually(t, "both write k2", func() bool {
		return a.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" && b.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:"
	})

	actx, acancel := context.WithCancel(ctx)
	defer acancel()
	migA, doneA := startMigrator(t, actx, cli, a, nil, 60) // about 2 s for 120 objects
	eventually(t, "a leads and has rewritten some objects", func() bool {
		_, l := migA.State()
		return l && countPrefix(t, cli, "k8s:enc:aesgcm:v1:k2:") >= 20
	})
	acancel()
	<-doneA
	done := countPrefix(t, cli, "k8s:enc:aesgcm:v1:k2:")
	if done >= n {
		t.Fatalf("the migration finished before the leader stopped (%d objects); slow it down", done)
	}
	ck, err := (&etcdCheckpoints{Client: cli, Key: coordination.MigrationCheckpoint(defaultPrefix)}).Load(context.Background())
	// (The checkpoint moves past a page only once all of it is handled; these objects
	// fit one page, so progress shows in the counters.)
	if err != nil || ck == nil || ck.Completed || ck.Resource != "secrets" || ck.Counters.Rewritten == 0 {
		t.Fatalf("checkpoint left by the stopped leader: %+v, %v; want one with progress", ck, err)
	}

	bctx, bcancel := context.WithCancel(ctx)
	defer bcancel()
	migB, doneB := startMigrator(t, bctx, cli, b, nil)
	eventually(t, "b finishes the migration", func() bool {
		st, l := migB.State()
		return l && st.Records["secrets"].Verified && st.Records["secrets"].Target.Key == "k2"
	})
	if got := countPrefix(t, cli, "k8s:enc:aesgcm:v1:k2:"); got != n {
		t.Fatalf("%d of %d objects on k2 after the new leader finished", got, n)
	}
	for i := range n { // nothing lost or garbled
		key := fmt.Sprintf("/registry/secrets/ns/s%03d", i)
		resp, err := cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("%s: %v %v", key, resp, err)
		}
		plain, _, err := b.agent.TransformerForResource(secrets).TransformFromStorage(ctx, resp.Kvs[0].Value, value.DefaultContext(key))
		if err != nil || string(plain) != string(storedObject(key)) {
			t.Fatalf("%s reads %q, %v", key, plain, err)
		}
	}
	bcancel()
	<-doneB
}
