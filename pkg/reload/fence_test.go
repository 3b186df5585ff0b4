package reload

import (
	"context"
	"sync"
	"sync/atomic"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// testFence holds back the configured write key of every rule until released, writing
// with the entry that wrote before (the way pkg/cluster's fence does).
type testFence struct {
	mu       sync.Mutex
	released bool
	calls    int
}

func (f *testFence) writers(current, next []transformers.RuleInfo) map[string]transformers.Writer {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.calls++
	if f.released {
		return nil
	}
	out := map[string]transformers.Writer{}
	for _, n := range next {
		for _, c := range current {
			if c.Resource != n.Resource {
				continue
			}
			for i, k := range n.ReadKeys {
				if k.SameEntry(c.ReadKeys[c.WriteIndex]) {
					out[n.Resource] = transformers.Writer{Index: i}
				}
			}
		}
	}
	return out
}

// TestWriteFenceHoldsThenRefencePromotes: a reload whose new write key the fence holds
// back applies the configuration but keeps writing with the previous key; Refence
// after the fence lets go writes with the new key, without a reload.
func TestWriteFenceHoldsThenRefencePromotes(t *testing.T) {
	fence := &testFence{}
	var changes atomic.Int64
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.WriteFence = fence.writers
		o.OnChange = func() { changes.Add(1) }
	})
	writeRename(t, f.path, secretsConfig("aesgcm:k2,k1"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := f.writePrefix(secrets); p != gcmK1 {
		t.Fatalf("write prefix after the held reload = %q, want the previous key %q", p, gcmK1)
	}
	st := f.agent.Status()
	if r := st.Resources[0]; r.WriteIndex != 1 || r.ReadKeys[0].Key != "k2" {
		t.Fatalf("status rule = %+v, want k2 configured and held (write index 1)", r)
	}
	held := f.mustWrite(secrets, "/registry/secrets/ns/a", "v")
	if _, stale, err := f.read(secrets, "/registry/secrets/ns/a", held); err != nil || !stale {
		t.Fatalf("a value written with the held-back writer: stale %v, err %v; want stale (not the config's first key)", stale, err)
	}
	if changes.Load() != 1 {
		t.Fatalf("OnChange calls = %d, want 1 (the reload)", changes.Load())
	}

	// Nothing changed: Refence swaps nothing.
	if err := f.agent.Refence(); err != nil {
		t.Fatal(err)
	}
	if changes.Load() != 1 {
		t.Fatalf("Refence without a new answer swapped (OnChange calls %d)", changes.Load())
	}
	fence.mu.Lock()
	fence.released = true
	fence.mu.Unlock()
	if err := f.agent.Refence(); err != nil {
		t.Fatal(err)
	}
	if p := f.writePrefix(secrets); p != gcmK2 {
		t.Fatalf("write prefix after promotion = %q, want %q", p, gcmK2)
	}
	if changes.Load() != 2 {
		t.Fatalf("OnChange calls = %d, want 2", changes.Load())
	}
	if h := f.agent.Status().ActiveConfigHash; h != f.agent.ActiveConfig().Hash {
		t.Fatalf("promotion changed the config hash")
	}
}

// TestWriteFenceAtStart: the fence is consulted for the first configuration too.
func TestWriteFenceAtStart(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k2,k1"), func(o *Options) {
		o.WriteFence = func(_, next []transformers.RuleInfo) map[string]transformers.Writer {
			return map[string]transformers.Writer{"secrets": {Index: 1}}
		}
	})
	if p := f.writePrefix(secrets); p != gcmK1 {
		t.Fatalf("write prefix = %q, want %q", p, gcmK1)
	}
}

// TestWriteFenceKeepsSharedKMSProviderOpen: promotion retires the previous Set, which
// shares its KMS providers with the promoted one; they must stay open.
func TestWriteFenceKeepsSharedKMSProviderOpen(t *testing.T) {
	fence := &testFence{}
	f := newFixture(t, secretsConfig("kms:vault", "aesgcm:k1"), func(o *Options) {
		o.WriteFence = fence.writers
		o.GracePeriod = 1 // close replaced Sets at once
	})
	writeRename(t, f.path, secretsConfig("aesgcm:k2", "kms:vault"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := f.writePrefix(secrets); p != transformers.KMSv2Prefix+"vault:" {
		t.Fatalf("write prefix = %q, want the held KMS provider", p)
	}
	fence.mu.Lock()
	fence.released = true
	fence.mu.Unlock()
	if err := f.agent.Refence(); err != nil {
		t.Fatal(err)
	}
	kms := f.plugins.all()
	eventually(t, "the first configuration's provider closed", func() bool { return kms[0].closed.Load() })
	if kms[1].closed.Load() {
		t.Fatal("the KMS provider shared by the promoted Set was closed when the held Set retired")
	}
}
