package layer

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/testutil"
	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

type recordedEvent struct {
	kind            events.Kind
	reason, message string
}

type eventLog struct {
	mu  sync.Mutex
	got []recordedEvent
}

func (e *eventLog) Event(kind events.Kind, reason, message string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.got = append(e.got, recordedEvent{kind, reason, message})
}

func (e *eventLog) take() []recordedEvent {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := e.got
	e.got = nil
	return out
}

type setTransformers struct{ s *transformers.Set }

func (t setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return t.s.TransformerFor(gr)
}

// The plugin's key behind the stored objects' key id gets other material (an alias
// re-pointed): every read is still served from the cached DEK, and only the probe,
// which has the plugin decrypt a stored DEK source past the cache, sees it. It raises
// one Warning Event naming the resource, provider, key id hash and object count (no
// key material, no plugin words), sets rekey_kms_decrypt_probe_failing, and clears it
// once the key is back. A plugin that does not answer is no finding.
func TestKMSDecryptProbe(t *testing.T) {
	ctx := context.Background()
	cli := etcdtest.Start(t).Client(t)
	kms := enctest.StartKMS(t, "kek1")
	yaml := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" + kms.ProviderYAML("plug")
	cfg := enctest.MustConfig(t, yaml)
	set := enctest.BuildReady(t, yaml, kms.Factory)
	secrets := schema.GroupResource{Resource: "secrets"}
	res := migrate.ResourceFor(migrate.DefaultEtcdPrefix, secrets)
	keys := enctest.WriteObjects(t, cli, set, secrets, res.KeyPrefix, 5)
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{res}})
	if err != nil {
		t.Fatal(err)
	}
	keyIDHash := inv.Find("secrets").Buckets[0].KeyIDHash
	store := &migrate.InventoryStore{}
	store.Set(inv)

	reg := metrics.NewKubeRegistry()
	m, err := newKMSProbeMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	evs := &eventLog{}
	probe := &kmsProbe{inventory: store, client: func() *clientv3.Client { return cli }, config: func() *config.Config { return cfg },
		tr: setTransformers{set}, events: evs, log: ktesting.NewLogger(t, ktesting.NewConfig()), m: m}
	failing := func(want string) {
		t.Helper()
		exp := ""
		if want != "" {
			exp = "# HELP rekey_kms_decrypt_probe_failing " + m.failing.Help + "\n# TYPE rekey_kms_decrypt_probe_failing gauge\n" + want + "\n"
		}
		if err := testutil.GatherAndCompare(reg, strings.NewReader(exp), "rekey_kms_decrypt_probe_failing"); err != nil {
			t.Fatal(err)
		}
		if n, err := testutil.GetGaugeMetricValue(m.failingKeyIDs); err != nil || (n > 0) != (want != "") {
			t.Fatalf("rekey_kms_decrypt_probe_failing_key_ids = %v (%v) with failing series %q", n, err, want)
		}
	}
	read := func() {
		t.Helper()
		resp, err := cli.Get(ctx, keys[0])
		if err != nil {
			t.Fatal(err)
		}
		if _, _, err := set.TransformerFor(secrets).TransformFromStorage(ctx, resp.Kvs[0].Value, value.DefaultContext(resp.Kvs[0].Key)); err != nil {
			t.Fatalf("a read through the serving transformers failed: %v", err)
		}
	}

	probe.once(ctx)
	if got := evs.take(); len(got) != 0 {
		t.Fatalf("events with the plugin's key intact: %+v", got)
	}
	failing("")

	// The same key id, other material.
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	if err := os.WriteFile(kms.KeysFile, []byte("keys:\n  - {name: kek1, secret: "+base64.StdEncoding.EncodeToString(secret)+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	touched(t, kms.KeysFile, 1)
	read()
	probe.once(ctx)
	got := evs.take()
	if len(got) != 1 || got[0].kind != events.Warning || got[0].reason != events.ReasonKMSDecryptProbeFailed {
		t.Fatalf("events after the key's material changed: %+v; want one Warning %s", got, events.ReasonKMSDecryptProbeFailed)
	}
	for _, want := range []string{"secrets: 5 objects", `kms provider "plug"`, keyIDHash, "cannot decrypt"} {
		if !strings.Contains(got[0].message, want) {
			t.Errorf("event message %q does not say %q", got[0].message, want)
		}
	}
	if strings.Contains(got[0].message, "kek1") || strings.Contains(got[0].message, base64.StdEncoding.EncodeToString(secret)) {
		t.Errorf("event message %q names the raw key id or key material", got[0].message)
	}
	failing(fmt.Sprintf(`rekey_kms_decrypt_probe_failing{key_id_hash=%q,provider="plug",resource="secrets"} 5`, keyIDHash))
	read() // still served from the cache
	probe.once(ctx)
	if got := evs.take(); len(got) != 0 {
		t.Fatalf("a second Event for the same finding: %+v", got)
	}

	// The key is back.
	kms.SetKeys(t, "kek1")
	touched(t, kms.KeysFile, 2)
	probe.once(ctx)
	failing("")

	// A plugin that does not answer is an outage, not a lost key.
	kms.Server.Stop()
	probe.once(ctx)
	if got := evs.take(); len(got) != 0 {
		t.Fatalf("events with the plugin down: %+v; an outage is not a lost key", got)
	}
	failing("")
}

// touched sets path's modification time n seconds ahead: the plugin reloads its keys
// file when its time or size changes, and two writes of one size within a clock tick
// would look like one.
func touched(t *testing.T, path string, n int) {
	t.Helper()
	at := time.Now().Add(time.Duration(n) * time.Second)
	if err := os.Chtimes(path, at, at); err != nil {
		t.Fatal(err)
	}
}
