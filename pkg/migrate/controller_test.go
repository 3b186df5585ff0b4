package migrate

import (
	"context"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// swappable serves whichever Set is current, like the reload agent.
type swappable struct {
	cur atomic.Pointer[transformers.Set]
}

func (s *swappable) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return s.cur.Load().TransformerFor(gr)
}

func TestControllerMigratesAfterWriteKeyChange(t *testing.T) {
	cli := startEtcd(t)
	_, s0 := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, s0, secrets, 300)
	sw := &swappable{}
	sw.cur.Store(s0)
	src := FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	c := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], AutoMigrate: true, CheckInterval: 20 * time.Millisecond, Logger: testLogger(t)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	defer func() { cancel(); <-done }()

	waitFor(t, func() bool { return c.Inventory().Latest() != nil })
	if inv := c.Inventory().Latest(); inv.Find("secrets").Stale != 0 {
		t.Fatalf("first inventory: %d stale", inv.Find("secrets").Stale)
	}
	// A reload makes key2 the write key: the controller migrates on its own.
	_, s1 := setFor(t, "secrets", "aesgcm:key2,key1")
	sw.cur.Store(s1)
	waitFor(t, func() bool {
		st := c.Status()
		return st.LastMigration != nil && st.LastMigration.Error == "" && st.Inventory != nil &&
			bucketCount(st.Inventory.Find("secrets"), "k8s:enc:aesgcm:v1:key2:", false) == 300
	})
	if st := c.Status(); st.LastMigration.Counters.Rewritten != 300 {
		t.Fatalf("last migration = %+v", st.LastMigration)
	}
}

func TestControllerWithoutAutoMigrateOnlyCounts(t *testing.T) {
	cli := startEtcd(t)
	_, s0 := setFor(t, "secrets", "aesgcm:key1")
	writeObjects(t, cli, s0, secrets, 50)
	sw := &swappable{}
	sw.cur.Store(s0)
	src := FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	c := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], AutoMigrate: false, CheckInterval: 20 * time.Millisecond, Logger: testLogger(t)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, func() bool { return c.Inventory().Latest() != nil })
	_, s1 := setFor(t, "secrets", "aesgcm:key2,key1")
	sw.cur.Store(s1)
	waitFor(t, func() bool {
		inv := c.Inventory().Latest()
		return inv.Find("secrets").WritePrefix == "k8s:enc:aesgcm:v1:key2:"
	})
	if inv := c.Inventory().Latest(); inv.Find("secrets").Stale != 50 || c.Status().LastMigration != nil {
		t.Fatalf("with auto-migrate off: stale %d, migration %+v", inv.Find("secrets").Stale, c.Status().LastMigration)
	}
}

func waitFor(t *testing.T, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatal("condition not met within 20 s")
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// A migration of one resource keeps the other resources in the inventory the guard
// reads, so a later change to them is still judged with counts.
func TestControllerMigrationKeepsOtherResourcesInInventory(t *testing.T) {
	cli := startEtcd(t)
	_, s0 := setFor(t, "secrets", "aesgcm:key1") // configmaps: identity throughout
	writeObjects(t, cli, s0, secrets, 20)
	writeObjects(t, cli, s0, configmaps, 5)
	sw := &swappable{}
	sw.cur.Store(s0)
	src := FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	c := NewController(ControllerOptions{Client: cli, Source: src, Resources: testResources(), AutoMigrate: true, CheckInterval: 20 * time.Millisecond, Logger: testLogger(t)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); c.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitFor(t, func() bool { return c.Inventory().Latest() != nil })

	// Only secrets change their write key.
	_, s1 := setFor(t, "secrets", "aesgcm:key2,key1")
	sw.cur.Store(s1)
	waitFor(t, func() bool {
		st := c.Status()
		return st.LastMigration != nil && st.LastMigration.Error == ""
	})
	inv := c.Inventory().Latest()
	if inv.Find("secrets") == nil || inv.Find("configmaps") == nil || inv.Find("configmaps").Objects != 5 {
		t.Fatalf("inventory after migrating secrets covers %+v, want secrets and configmaps", inv.Resources)
	}
	if got := bucketCount(inv.Find("secrets"), "k8s:enc:aesgcm:v1:key2:", false); got != 20 {
		t.Fatalf("secrets on key2: %d", got)
	}
}
