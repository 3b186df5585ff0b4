package kmsv2

import (
	"bytes"
	"context"
	"crypto/fips140"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

var secrets = schema.GroupResource{Resource: "secrets"}

// loadUpstream builds kube-apiserver's transformers for the plugin; they stop with the test.
func loadUpstream(t testing.TB, tp *testPlugin, name string) value.Transformer {
	t.Helper()
	if fips140.Enforced() {
		t.Skip("impossible under GODEBUG=fips140=only: the test compares rekey with upstream's KMS v2 transformer, which seals with cipher.NewGCM, refused in this mode")
	}
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ec, err := encryptionconfig.LoadEncryptionConfig(ctx, upstreamConfig(t, tp.dir, name, tp.endpoint), true, "id")
	if err != nil {
		t.Fatal(err)
	}
	tr := ec.Transformers[secrets]
	// Upstream primes inline; wait until its first write works.
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := tr.TransformToStorage(ctx, []byte("probe"), aad); err == nil {
			return tr
		} else if time.Now().After(deadline) {
			t.Fatalf("upstream transformer never became ready: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // polling a foreign component, not the state machine
	}
}

// loadOurs builds our Set through transformers.Build, as the agent does.
func loadOurs(t testing.TB, tp *testPlugin, name string, o FactoryOptions) (value.Transformer, *Provider) {
	t.Helper()
	return loadOursWith(t, tp, name, transformers.Options{}, o)
}

// loadOursWith is loadOurs with the transformers' options (e.g. a fake clock).
func loadOursWith(t testing.TB, tp *testPlugin, name string, topts transformers.Options, o FactoryOptions) (value.Transformer, *Provider) {
	t.Helper()
	cfg, err := config.Load(upstreamConfig(t, tp.dir, name+"-ours", tp.endpoint), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Encryption.Resources[0].Providers[0].KMS.Name = name
	o.Registry = metrics.NewKubeRegistry()
	topts.KMS = NewFactory(o)
	set, err := transformers.Build(context.Background(), cfg, topts)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for _, k := range set.KMSProviders() {
		if err := k.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return set.TransformerFor(secrets), set.KMSProviders()[0].(*Provider)
}

func roundTrip(t *testing.T, what string, w, r value.Transformer, wantStale bool) {
	t.Helper()
	ctx := context.Background()
	for _, n := range []int{1, 256, 4096, 65536} {
		pt := bytes.Repeat([]byte{byte(n)}, n)
		stored, err := w.TransformToStorage(ctx, pt, aad)
		if err != nil {
			t.Fatalf("%s: write: %v", what, err)
		}
		got, stale, err := r.TransformFromStorage(ctx, stored, aad)
		if err != nil || !bytes.Equal(got, pt) || stale != wantStale {
			t.Fatalf("%s (%d bytes): read stale=%v err=%v equal=%v; want stale=%v", what, n, stale, err, bytes.Equal(got, pt), wantStale)
		}
		if _, _, err := r.TransformFromStorage(ctx, stored, value.DefaultContext("/registry/secrets/other/key")); err == nil {
			t.Fatalf("%s: value moved to another etcd key was accepted", what)
		}
	}
}

func TestUpstreamCompatibilitySeed(t *testing.T) {
	tp := startPlugin(t, "key-1")
	up := loadUpstream(t, tp, "compat-seed")
	ours, _ := loadOurs(t, tp, "compat-seed", FactoryOptions{})
	roundTrip(t, "upstream → rekey", up, ours, false)
	roundTrip(t, "rekey → upstream", ours, up, false)
	roundTrip(t, "rekey → rekey", ours, ours, false)
}

// Under GODEBUG=fips140=only the provider seals with random nonces (Go refuses AES-GCM
// with the caller's nonces there): the same bytes on the wire, read by kube-apiserver
// and read back by a provider that seals with counter nonces, and the reverse.
func TestUpstreamCompatibilitySeedRandomNonces(t *testing.T) {
	tp := startPlugin(t, "key-1")
	up := loadUpstream(t, tp, "compat-random")
	random, p := loadOursWith(t, tp, "compat-random", transformers.Options{FIPS: transformers.FIPSOnly}, FactoryOptions{})
	if !p.opts.RandomNonces {
		t.Fatal("FIPSOnly did not turn on random nonces")
	}
	counter, _ := loadOurs(t, tp, "compat-random", FactoryOptions{})
	roundTrip(t, "upstream → rekey (random nonces)", up, random, false)
	roundTrip(t, "rekey (random nonces) → upstream", random, up, false)
	roundTrip(t, "rekey (random nonces) → rekey (counter nonces)", random, counter, false)
	roundTrip(t, "rekey (counter nonces) → rekey (random nonces)", counter, random, false)

	// Two writes under one derived key carry unrelated nonces, not a counter's.
	ctx := context.Background()
	dc := value.DefaultContext("/registry/secrets/default/n")
	var nonces [2][]byte
	for i := range nonces {
		out, err := random.TransformToStorage(ctx, []byte("same plaintext"), dc)
		if err != nil {
			t.Fatal(err)
		}
		var o wire.Object
		if _, err := wire.Decode(out[len("k8s:enc:kms:v2:compat-random:"):], &o, nil); err != nil {
			t.Fatal(err)
		}
		nonces[i] = o.Data[infoSize : infoSize+nonceSize]
	}
	if string(nonces[0][:4]) == string(nonces[1][:4]) {
		t.Errorf("two random-nonce writes share the nonce's first 4 bytes (%x, %x): a counter's prefix", nonces[0], nonces[1])
	}
}

func TestUpstreamCompatibilityAESGCMKey(t *testing.T) {
	tp := startPlugin(t, "key-1")
	restore := encryptionconfig.SetKDFForTests("compat-key", false)
	defer restore()
	up := loadUpstream(t, tp, "compat-key")
	ours, _ := loadOurs(t, tp, "compat-key", FactoryOptions{})
	// Same key id, other DEK source type: stale on both sides.
	roundTrip(t, "upstream(AES_GCM_KEY) → rekey", up, ours, true)
	roundTrip(t, "rekey(seed) → upstream(AES_GCM_KEY)", ours, up, true)
}

func TestUpstreamCompatibilityKeyIDChange(t *testing.T) {
	tp := startPlugin(t, "key-1")
	up1 := loadUpstream(t, tp, "compat-rot")
	ours, oursProvider := loadOurs(t, tp, "compat-rot", FactoryOptions{HealthyTTL: time.Nanosecond})
	ctx := context.Background()
	upOld, _ := up1.TransformToStorage(ctx, []byte("upstream-old"), aad)
	ourOld, _ := ours.TransformToStorage(ctx, []byte("ours-old"), aad)

	tp.writeKeys(t, "key-2", "key-1")
	// A fresh upstream load sees key-2 at once; ours rotates once its Statuses have
	// confirmed it (DefaultKeyIDConfirmations).
	up2 := loadUpstream(t, tp, "compat-rot")
	cctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	for range DefaultKeyIDConfirmations {
		if err := oursProvider.Check(cctx); err != nil {
			t.Fatal(err)
		}
	}
	for _, c := range []struct {
		what  string
		r     value.Transformer
		v     []byte
		want  string
		stale bool
	}{
		{"rekey reads upstream key-1 value", ours, upOld, "upstream-old", true},
		{"rekey reads its own key-1 value", ours, ourOld, "ours-old", true},
		{"upstream reads rekey key-1 value", up2, ourOld, "ours-old", true},
		{"upstream reads its own key-1 value", up2, upOld, "upstream-old", true},
	} {
		got, stale, err := c.r.TransformFromStorage(ctx, c.v, aad)
		if err != nil || string(got) != c.want || stale != c.stale {
			t.Errorf("%s: %q stale=%v err=%v; want stale=%v", c.what, got, stale, err, c.stale)
		}
	}
	roundTrip(t, "upstream(key-2) → rekey(key-2)", up2, ours, false)
	roundTrip(t, "rekey(key-2) → upstream(key-2)", ours, up2, false)
}
