package guard

import (
	"context"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

type currentSet struct {
	cur atomic.Pointer[transformers.Set]
}

func (s *currentSet) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return s.cur.Load().TransformerFor(gr)
}

// TestARelabelledInventoryIsOutdated: a write key change makes the controller judge its
// latest inventory again instead of scanning (migrate.Inventory.RelabelledAt). Its
// counts are of the scan, and objects were written with the old write key after it, so
// the guard must not take it as covering: dropping that key is refused until a scan
// under the new write key.
func TestARelabelledInventoryIsOutdated(t *testing.T) {
	cli := startEtcd(t)
	_, s0 := setFor(t, "secrets", "aesgcm:key1,key0")
	sw := &currentSet{}
	sw.cur.Store(s0)
	src := migrate.FromRules(sw, func() []transformers.RuleInfo { return sw.cur.Load().Rules() })
	ctrl := migrate.NewController(migrate.ControllerOptions{Client: cli, Source: src, Resources: testResources()[:1], CheckInterval: 10 * time.Millisecond, InventoryInterval: time.Hour, Logger: testLogger(t)})
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); ctrl.Run(ctx) }()
	defer func() { cancel(); <-done }()
	waitUntil(t, "the first inventory", func() bool { return ctrl.Inventory().Latest() != nil })
	// Written with key1 after the scan: no inventory counted them.
	writeObjects(t, cli, s0, secrets, 8)
	cur, s1 := setFor(t, "secrets", "aesgcm:key2,key1,key0")
	sw.cur.Store(s1)
	waitUntil(t, "the inventory relabelled", func() bool { return !ctrl.Inventory().Latest().RelabelledAt.IsZero() })
	next := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2,key0"))
	v := CheckChange(ctrl.Inventory().Latest(), cur, next)
	if len(v) == 0 || !strings.Contains(v[0].String(), `"key1"`) || !strings.Contains(v[0].String(), "may still hold objects") {
		t.Fatalf("dropping key1 on a relabelled inventory: %v; want it refused (8 objects are stored under it)", v)
	}
}

func waitUntil(t *testing.T, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(20 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
