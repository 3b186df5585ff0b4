package cluster

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
)

// TestGuardFailsClosedOnAnUnknownMigrationState: dropping a key nobody writes with is
// refused, without announcing the drop, while the cluster's migration state cannot be
// read (the read times out), does not decode, or — on an apiserver whose migrator
// follows the leader — has not been loaded yet or does not decode there; it is let
// through once a state that decodes shows nothing running.
func TestGuardFailsClosedOnAnUnknownMigrationState(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	a := startMember(t, cli, "a", secretsConfig("k2", "k1"))
	eventually(t, "a alone writes k2", func() bool { return a.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })
	parse := func(content string) *config.Config {
		t.Helper()
		c, err := config.Parse([]byte(content), "enc.yaml", config.Options{Reload: true})
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	current, next := parse(secretsConfig("k2", "k1")), parse(secretsConfig("k2")) // drops k1
	key := migrationStateKey(defaultPrefix)
	put := func(v string) {
		t.Helper()
		if _, err := cli.Put(context.Background(), key, v); err != nil {
			t.Fatal(err)
		}
	}
	idle, err := json.Marshal(MigrationState{Leader: "a", Records: map[string]Record{}})
	if err != nil {
		t.Fatal(err)
	}
	refused := func(t *testing.T, err error, cause string) {
		t.Helper()
		var r *guard.RefusedError
		if !errors.As(err, &r) {
			t.Fatalf("guard = %v, want a refusal", err)
		}
		if msg := err.Error(); !strings.Contains(msg, "cannot read the cluster's migration state; retrying") || !strings.Contains(msg, cause) {
			t.Fatalf("guard refused with %q, want \"cannot read the cluster's migration state; retrying\" and %q", msg, cause)
		}
		a.node.mu.Lock()
		announced := a.node.dropping != nil
		a.node.mu.Unlock()
		if announced {
			t.Fatal("the drop was announced although the guard refused it")
		}
	}

	t.Run("state read times out", func(t *testing.T) {
		put(string(idle))
		ctx, cancel := context.WithTimeout(context.Background(), time.Nanosecond)
		defer cancel()
		<-ctx.Done()
		refused(t, a.node.guard(ctx, current, next), context.DeadlineExceeded.Error())
	})
	t.Run("state does not decode", func(t *testing.T) {
		put(`{"running": {"resource": "secrets"`)
		refused(t, a.node.Guard(current, next), key+" does not decode")
	})
	t.Run("follower has not loaded the state", func(t *testing.T) {
		put(string(idle))
		m := NewMigrator(MigratorOptions{Client: cli, Prefix: defaultPrefix, ID: "a", Logger: ktesting.NewLogger(t, ktesting.NewConfig())})
		a.node.SetMigrator(m)
		defer a.node.SetMigrator(nil)
		refused(t, a.node.Guard(current, next), "has not loaded it from etcd yet")
	})
	t.Run("follower's latest state does not decode", func(t *testing.T) {
		put(`{"running": {"resource": "secrets"`)
		m := NewMigrator(MigratorOptions{Client: cli, Prefix: defaultPrefix, ID: "a", Logger: ktesting.NewLogger(t, ktesting.NewConfig())})
		ctx, cancel := context.WithCancel(context.Background())
		followed := make(chan struct{})
		go func() { defer close(followed); m.follow(ctx) }()
		defer func() { cancel(); <-followed }()
		a.node.SetMigrator(m)
		defer a.node.SetMigrator(nil)
		eventually(t, "the follower read the state", func() bool { m.mu.Lock(); defer m.mu.Unlock(); return m.loaded })
		refused(t, a.node.Guard(current, next), key+" does not decode")

		// Loaded and idle: nothing says a migration needs k1.
		put(string(idle))
		eventually(t, "the follower sees the idle state", func() bool { _, err := m.knownState(); return err == nil })
		if err := a.node.Guard(current, next); err != nil {
			t.Fatalf("guard with a loaded, idle migration state = %v, want the drop let through", err)
		}
	})
	t.Run("state read and idle", func(t *testing.T) {
		put(string(idle))
		if err := a.node.Guard(current, next); err != nil {
			t.Fatalf("guard with an idle migration state = %v, want the drop let through", err)
		}
	})
	t.Run("state read and running", func(t *testing.T) {
		running, err := json.Marshal(MigrationState{Leader: "a", Records: map[string]Record{},
			Running: &Migration{Resource: "secrets", Target: Key{Provider: "aesgcm", Key: "k2"}}})
		if err != nil {
			t.Fatal(err)
		}
		put(string(running))
		err = a.node.Guard(current, next)
		if err == nil || !strings.Contains(err.Error(), "while the migration to aesgcm/k2 runs") {
			t.Fatalf("guard while a migration of secrets runs = %v, want a refusal naming it", err)
		}
	})
}
