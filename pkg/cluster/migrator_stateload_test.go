package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// stateGetFailer is a clientv3.KV whose Gets of one key fail while it is blocked (etcd
// not answering for that read); everything else goes to etcd.
type stateGetFailer struct {
	clientv3.KV
	key string

	mu      sync.Mutex
	blocked bool
	failed  int
}

func (f *stateGetFailer) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	f.mu.Lock()
	if f.blocked && key == f.key {
		f.failed++
		f.mu.Unlock()
		return nil, errors.New("injected: etcd does not answer")
	}
	f.mu.Unlock()
	return f.KV.Get(ctx, key, opts...)
}

func (f *stateGetFailer) unblock() {
	f.mu.Lock()
	f.blocked = false
	f.mu.Unlock()
}

func (f *stateGetFailer) failures() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.failed
}

// storedStateRev is the mod revision of the stored migration state (0: none).
func storedStateRev(t *testing.T, cli *clientv3.Client) int64 {
	t.Helper()
	resp, err := cli.Get(context.Background(), migrationStateKey(defaultPrefix))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		return 0
	}
	return resp.Kvs[0].ModRevision
}

// watchStatePuts collects every value put at the migration state key from now on.
func watchStatePuts(t *testing.T, ctx context.Context, cli *clientv3.Client) func() []string {
	t.Helper()
	var mu sync.Mutex
	var puts []string
	wch := cli.Watch(ctx, migrationStateKey(defaultPrefix))
	go func() {
		for resp := range wch {
			mu.Lock()
			for _, ev := range resp.Events {
				if ev.Type == mvccpb.PUT {
					puts = append(puts, string(ev.Kv.Value))
				}
			}
			mu.Unlock()
		}
	}()
	return func() []string {
		mu.Lock()
		defer mu.Unlock()
		return append([]string(nil), puts...)
	}
}

// TestMigratorLeaderKeepsRecordsItCouldNotReadYet: a newly elected leader whose read of
// the stored state fails publishes nothing until a read succeeds, and then keeps the
// stored records (a record of a resource it does not migrate included).
func TestMigratorLeaderKeepsRecordsItCouldNotReadYet(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	stored := MigrationState{Leader: "old", Records: map[string]Record{
		"configmaps": {Target: Key{Provider: "aesgcm", Key: "k0"}, Verified: true, Revision: 7},
	}}
	data, err := json.Marshal(stored)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, migrationStateKey(defaultPrefix), string(data)); err != nil {
		t.Fatal(err)
	}
	storedRev := storedStateRev(t, cli)
	puts := watchStatePuts(t, ctx, cli)

	a := startMember(t, cli, "a", secretsConfig("k1"))
	migCli := srv.Client(t)
	failer := &stateGetFailer{KV: migCli.KV, key: migrationStateKey(defaultPrefix), blocked: true}
	migCli.KV = failer
	mig, done := startMigrator(t, ctx, migCli, a, nil)
	defer func() { cancel(); <-done }()

	eventually(t, "a leads", func() bool { _, l := mig.State(); return l })
	before := failer.failures()
	// The leader tries its read again (fixed), or publishes over the state (the bug).
	eventually(t, "the leader retries its read, or publishes", func() bool {
		return failer.failures() >= before+2 || storedStateRev(t, cli) != storedRev
	})
	if rev := storedStateRev(t, cli); rev != storedRev {
		t.Fatalf("the leader published the state (revision %d, stored at %d) before it could read it: %q", rev, storedRev, puts())
	}
	if _, err := mig.knownState(); err == nil {
		t.Fatal("the state counts as known while the leader cannot read it")
	}

	failer.unblock()
	eventually(t, "the leader publishes its state", func() bool {
		st, _, err := readMigrationStateAt(ctx, cli, defaultPrefix)
		return err == nil && st.Leader == "a"
	})
	for _, p := range puts() {
		var st MigrationState
		if err := json.Unmarshal([]byte(p), &st); err != nil {
			t.Fatalf("published state does not decode: %v", err)
		}
		if r, ok := st.Records["configmaps"]; !ok || !r.Verified || r.Target.Key != "k0" || r.Revision != 7 {
			t.Fatalf("a published state lost the stored record: %s", p)
		}
	}
}

// TestMigratorLeaderNeverOverwritesUndecodableState: a leader that finds a state it
// cannot decode leaves it, starts no migration, says why and what to do, and starts
// once an operator deleted it.
func TestMigratorLeaderNeverOverwritesUndecodableState(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	const bad = `{"records": not json`
	key := migrationStateKey(defaultPrefix)
	if _, err := cli.Put(ctx, key, bad); err != nil {
		t.Fatal(err)
	}
	a := startMember(t, cli, "a", secretsConfig("k1"))
	storeSecrets(t, cli, a, 5, "/registry/secrets/ns/s%02d")
	log := &eventLog{}
	// Each read of the state that does not decode logs the hold once.
	var held atomic.Int32
	logger := funcr.New(func(_, args string) {
		if strings.Contains(args, "Storage migration held") {
			held.Add(1)
		}
	}, funcr.Options{})
	mig := NewMigrator(MigratorOptions{
		Client: cli, Prefix: defaultPrefix, ID: a.id, SessionTTL: 10 * time.Second,
		Resources:      []migrate.Resource{migrate.ResourceFor("/registry", secrets)},
		Source:         migrate.FromRules(a.agent, a.agent.Rules),
		Members:        a.node.view.Members,
		MembersChanged: a.node.view.Changed,
		Logger:         logger,
		Events:         log,
	})
	a.node.SetMigrator(mig)
	done := make(chan struct{})
	go func() { defer close(done); mig.Run(ctx) }()
	defer func() { cancel(); <-done }()

	eventually(t, "a leads", func() bool { _, l := mig.State(); return l })
	eventually(t, "the leader to read the state three times", func() bool { return held.Load() >= 3 })
	resp, err := cli.Get(ctx, key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) != 1 || string(resp.Kvs[0].Value) != bad {
		t.Fatalf("the undecodable state was overwritten: %q", resp.Kvs)
	}
	if last := mig.LastMigration(); last != nil {
		t.Fatalf("a migration ran while the state did not decode: %+v", last)
	}
	if st, _ := mig.State(); st.Running != nil {
		t.Fatalf("a migration runs while the state does not decode: %+v", st.Running)
	}
	if _, err := mig.knownState(); err == nil {
		t.Fatal("the state counts as known while it does not decode")
	}
	eventually(t, "an event says the state does not decode and what to do", func() bool {
		return log.has("does not decode") && log.has("etcdctl del "+key)
	})

	// The operator deletes it: the leader starts from no records.
	if _, err := cli.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the leader migrates and publishes", func() bool {
		st, _, err := readMigrationStateAt(ctx, cli, defaultPrefix)
		return err == nil && st.Leader == "a" && st.Records["secrets"].Verified
	})
}
