package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// TestStatePublisherWritesWhatIsDue: the leader's state is written when it changed,
// every second while a migration runs, every 30 s otherwise, and never once the
// leadership guard fails. Each "not written" is asserted at the instant just before it
// would be due, by the key's revision.
func TestStatePublisherWritesWhatIsDue(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	lk, guard := holdLeaderKey(t, cli)
	p := &statePublisher{client: cli, key: migrationStateKey(defaultPrefix), guard: guard}
	version := func() int64 {
		t.Helper()
		resp, err := cli.Get(ctx, p.key)
		if err != nil {
			t.Fatal(err)
		}
		if len(resp.Kvs) == 0 {
			return 0
		}
		return resp.Kvs[0].Version
	}
	st := func(at time.Duration, leader string) MigrationState {
		return MigrationState{Leader: leader, Records: map[string]Record{}, UpdatedAt: epoch.Add(at)}
	}
	steps := []struct {
		what    string
		st      MigrationState
		running bool
		version int64
	}{
		{"first state", st(0, "a"), false, 1},
		{"unchanged, 29.999 s later", st(30*time.Second-time.Millisecond, "a"), false, 1},
		{"unchanged, 30 s later", st(30*time.Second, "a"), false, 2},
		{"changed", st(31*time.Second, "b"), false, 3},
		{"running, 0.999 s later", st(32*time.Second-time.Millisecond, "b"), true, 3},
		{"running, 1 s later", st(32*time.Second, "b"), true, 4},
	}
	for _, s := range steps {
		if err := p.publish(s.st, s.running); err != nil {
			t.Fatalf("%s: %v", s.what, err)
		}
		if got := version(); got != s.version {
			t.Fatalf("%s: state key at version %d, want %d", s.what, got, s.version)
		}
	}
	if _, err := cli.Delete(ctx, lk); err != nil {
		t.Fatal(err)
	}
	if err := p.publish(st(33*time.Second, "c"), true); !errors.Is(err, errNotLeader) {
		t.Fatalf("publish after the leadership was lost = %v, want errNotLeader", err)
	}
	if got := version(); got != 4 {
		t.Fatalf("a deposed leader wrote the state (version %d)", got)
	}
}

// TestFollowerWatchesTheState: a follower sees each new state and a deletion through
// its watch (its clock never moves, so no timer could have shown them), and a watch
// from a compacted revision ends so that the state is read again.
func TestFollowerWatchesTheState(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := NewMigrator(MigratorOptions{Client: cli, Prefix: defaultPrefix, ID: "b",
		Logger: ktesting.NewLogger(t, ktesting.NewConfig()), Clock: clocktesting.NewFakeClock(epoch)})
	key := migrationStateKey(defaultPrefix)
	putState := func(leader string) int64 {
		t.Helper()
		data, err := json.Marshal(MigrationState{Leader: leader, Records: map[string]Record{"secrets": {Verified: true}}})
		if err != nil {
			t.Fatal(err)
		}
		resp, err := cli.Put(ctx, key, string(data))
		if err != nil {
			t.Fatal(err)
		}
		return resp.Header.Revision
	}
	leader := func() string { st, _ := m.State(); return st.Leader }

	old := putState("a")
	putState("b")
	latest := putState("c")
	if _, err := cli.Compact(ctx, latest); err != nil {
		t.Fatal(err)
	}
	ended := make(chan struct{})
	go func() {
		defer close(ended)
		m.followFrom(ctx, MigrationState{}, old, nil, &clientsReporter{m: m, parent: ctx})
	}()
	select {
	case <-ended:
	case <-time.After(20 * time.Second):
		t.Fatal("a watch from a compacted revision did not end")
	}

	followed := make(chan struct{})
	go func() { defer close(followed); m.follow(ctx) }()
	eventually(t, "the state read at the start", func() bool { return leader() == "c" })
	putState("d")
	eventually(t, "the new state seen through the watch", func() bool { return leader() == "d" })
	if _, err := cli.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	eventually(t, "the deletion seen through the watch", func() bool { st, _ := m.State(); return st.Leader == "" && len(st.Records) == 0 })
	cancel()
	<-followed
}

// TestFollowerStateIsUnknownUntilReadAndWhileItDoesNotDecode: a follower's migration
// state is unknown (knownState fails) before its first read and while the latest state
// in etcd does not decode, whether read at the start or seen through the watch; a state
// that decodes, or its deletion, makes it known again.
func TestFollowerStateIsUnknownUntilReadAndWhileItDoesNotDecode(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := NewMigrator(MigratorOptions{Client: cli, Prefix: defaultPrefix, ID: "b",
		Logger: ktesting.NewLogger(t, ktesting.NewConfig()), Clock: clocktesting.NewFakeClock(epoch)})
	key := migrationStateKey(defaultPrefix)
	put := func(v string) {
		t.Helper()
		if _, err := cli.Put(ctx, key, v); err != nil {
			t.Fatal(err)
		}
	}
	unknown := func(want string) func() bool {
		return func() bool {
			_, err := m.knownState()
			return err != nil && strings.Contains(err.Error(), want)
		}
	}
	known := func(leader string) func() bool {
		return func() bool {
			st, err := m.knownState()
			return err == nil && st.Leader == leader
		}
	}

	if _, err := m.knownState(); !errors.Is(err, errStateNotLoaded) {
		t.Fatalf("knownState before the first read = %v, want %v", err, errStateNotLoaded)
	}
	put(`{"leader": "a", "records": {`)
	followed := make(chan struct{})
	go func() { defer close(followed); m.follow(ctx) }()
	eventually(t, "an undecodable state read at the start is unknown", unknown(key+" does not decode"))
	put(`{"leader": "a", "records": {}}`)
	eventually(t, "a state that decodes is known", known("a"))
	put(`not json`)
	eventually(t, "an undecodable state seen through the watch is unknown", unknown(key+" does not decode"))
	if st, _ := m.State(); st.Leader != "a" {
		t.Errorf("the status document lost the last state that decoded: leader %q, want a", st.Leader)
	}
	if _, err := cli.Delete(ctx, key); err != nil {
		t.Fatal(err)
	}
	eventually(t, "no state (deleted) is known: nothing runs", known(""))
	cancel()
	<-followed
}
