package transformers_test

import (
	"bytes"
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/features"
	"k8s.io/apiserver/pkg/storage/value"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	featuregatetesting "k8s.io/component-base/featuregate/testing"

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// upstreamKMSv1 turns upstream's KMSv1 feature gate on for the test: upstream builds
// KMS v1 providers only then (rekey reads them without a gate).
func upstreamKMSv1(t testing.TB) {
	featuregatetesting.SetFeatureGateDuringTest(t, utilfeature.DefaultFeatureGate, features.KMSv1, true)
}

// loadUpstream is kube-apiserver's transformer for secrets under yaml.
func loadUpstream(t testing.TB, yaml string) value.Transformer {
	t.Helper()
	_, up := loadUpstreamFile(t, "upstream", yaml)
	return up.TransformerForResource(secrets)
}

func kmsv1YAML(p *enctest.KMS, name string) string {
	return fmt.Sprintf("      - kms:\n          name: %s\n          endpoint: %s\n          timeout: 3s\n", name, p.Endpoint())
}

// TestKMSv1UpstreamWritesRekeyReads: values upstream's KMS v1 envelope wrote — through
// kube-apiserver's own configuration loader with the v1 provider first (the data cipher
// of 1.25 and later, AES-GCM), and through its envelope transformer with the data
// cipher of 1.24 and earlier (AES-CBC) — read the same with upstream's and rekey's
// transformers for a configuration that writes with aesgcm and keeps the v1 provider
// behind it: same plaintext, same stale flag, same failures.
func TestKMSv1UpstreamWritesRekeyReads(t *testing.T) {
	upstreamKMSv1(t)
	plugin := enctest.StartKMSv1(t, "kek1")
	ctx := context.Background()
	header := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	v1 := kmsv1YAML(plugin, "old")
	writers := []struct {
		name string
		t    value.Transformer
		cbc  bool
	}{
		{"upstream config, v1 first (1.25+: AES-GCM)", loadUpstream(t, header+v1), false},
		{"upstream envelope, 1.24 data cipher (AES-CBC)", enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", true), true},
		{"upstream envelope, AES-GCM", enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", false), false},
	}
	reader := loadPair(t, "aesgcm,kmsv1", header+compatconfigs.ProviderYAML["aesgcm"]+v1)
	// Upstream reads v1 values with the v1 provider first as well; rekey's reader of
	// that position is the v1 provider alone (config refuses it there), so its stale
	// flag is the provider's own: false for GCM, true for CBC, as upstream's.
	upstreamV1First := loadUpstream(t, header+v1)
	aad := value.DefaultContext("/registry/secrets/ns/name")
	plaintexts := [][]byte{[]byte("k8s\x00\x0a\x0fsome secret protobuf"), {}, bytes.Repeat([]byte{0xa5}, 16), bytes.Repeat([]byte("x"), 4097)}
	for _, w := range writers {
		for _, pt := range plaintexts {
			stored, err := w.t.TransformToStorage(ctx, pt, aad)
			if err != nil {
				t.Fatalf("%s: write: %v", w.name, err)
			}
			if !bytes.HasPrefix(stored, []byte("k8s:enc:kms:v1:old:")) {
				t.Fatalf("%s: stored prefix %q", w.name, storedPrefix(stored))
			}
			where := fmt.Sprintf("%s, %d bytes", w.name, len(pt))
			upOut, upStale, upErr := reader.up(secrets).TransformFromStorage(ctx, stored, aad)
			ourOut, ourStale, ourErr := reader.our(secrets).TransformFromStorage(ctx, stored, aad)
			if upErr != nil || ourErr != nil {
				t.Fatalf("%s: upstream err=%v, rekey err=%v", where, upErr, ourErr)
			}
			if !bytes.Equal(upOut, pt) || !bytes.Equal(ourOut, pt) || !upStale || !ourStale {
				t.Fatalf("%s: upstream (ok=%v stale=%v), rekey (ok=%v stale=%v); want the plaintext, stale", where, bytes.Equal(upOut, pt), upStale, bytes.Equal(ourOut, pt), ourStale)
			}
			_, firstStale, err := upstreamV1First.TransformFromStorage(ctx, stored, aad)
			if err != nil || firstStale != w.cbc {
				t.Fatalf("%s: upstream with v1 first: err=%v stale=%v, want stale only for CBC", where, err, firstStale)
			}
			// The authenticated data is the etcd key for GCM and nothing for CBC, on
			// both sides.
			moved := value.DefaultContext("/registry/secrets/ns/other")
			_, _, upErr = reader.up(secrets).TransformFromStorage(ctx, stored, moved)
			_, _, ourErr = reader.our(secrets).TransformFromStorage(ctx, stored, moved)
			if (upErr == nil) != w.cbc || (ourErr == nil) != w.cbc {
				t.Fatalf("%s moved to another etcd key: upstream err=%v, rekey err=%v; want failure only for GCM", where, upErr, ourErr)
			}
		}
	}
	// Reads of one value reuse its DEK: the plugin decrypts it once.
	stored, err := writers[0].t.TransformToStorage(ctx, []byte("cached"), aad)
	if err != nil {
		t.Fatal(err)
	}
	before := plugin.Server.Stats().Decrypt
	for range 5 {
		if _, _, err := reader.our(secrets).TransformFromStorage(ctx, stored, aad); err != nil {
			t.Fatal(err)
		}
	}
	if n := plugin.Server.Stats().Decrypt - before; n != 1 {
		t.Fatalf("5 reads of one value called the plugin's Decrypt %d times, want 1 (DEK cache)", n)
	}
	// rekey never writes with KMS v1, whatever chooses the writer.
	if _, err := reader.ours.WithWriters(map[string]transformers.Writer{"secrets": {Index: 2}}); err != nil {
		t.Fatal(err)
	}
	only, _ := reader.ours.WithWriters(map[string]transformers.Writer{"secrets": {Index: 2}})
	defer only.Close()
	if _, err := only.TransformerFor(secrets).TransformToStorage(ctx, []byte("x"), aad); err == nil || !strings.Contains(err.Error(), "KMS v1 can only be read") {
		t.Fatalf("a write through the KMS v1 provider: %v, want the read-only refusal", err)
	}
}

// TestKMSv1RekeyRewritesUpstreamReads is the reverse direction: rekey never writes KMS
// v1, so what it writes is a KMS v1 value rewritten under the write key (what `rekey
// migrate` does), and upstream's transformers for that provider read it as current.
func TestKMSv1RekeyRewritesUpstreamReads(t *testing.T) {
	upstreamKMSv1(t)
	v1plugin := enctest.StartKMSv1(t, "kek1")
	v2plugin := enctest.StartKMS(t, "v2key")
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/ns/name")
	header := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	v1 := kmsv1YAML(v1plugin, "old")
	for _, target := range []struct{ name, yaml string }{
		{"aesgcm", compatconfigs.ProviderYAML["aesgcm"]},
		{"kms v2", v2plugin.ProviderYAML("new")},
	} {
		yaml := header + target.yaml + v1
		ours := enctest.BuildReady(t, yaml, v2plugin.Factory).TransformerFor(secrets)
		up := loadUpstream(t, yaml)
		for _, cbc := range []bool{false, true} {
			pt := []byte(fmt.Sprintf("secret of a v1 cluster (cbc=%v)", cbc))
			old, err := enctest.UpstreamKMSv1(t, v1plugin.Endpoint(), "old", cbc).TransformToStorage(ctx, pt, aad)
			if err != nil {
				t.Fatal(err)
			}
			read, stale, err := ours.TransformFromStorage(ctx, old, aad)
			if err != nil || !stale || !bytes.Equal(read, pt) {
				t.Fatalf("%s: rekey read of the v1 value: err=%v stale=%v", target.name, err, stale)
			}
			rewritten, err := ours.TransformToStorage(ctx, read, aad)
			if err != nil {
				t.Fatal(err)
			}
			if bytes.HasPrefix(rewritten, []byte(transformers.KMSv1Prefix)) {
				t.Fatalf("%s: rekey rewrote a value with KMS v1", target.name)
			}
			out, stale, err := readWhenReady(ctx, up, rewritten, aad)
			if err != nil || stale || !bytes.Equal(out, pt) {
				t.Fatalf("%s: upstream read of rekey's rewrite (%q): err=%v stale=%v", target.name, storedPrefix(rewritten), err, stale)
			}
		}
	}
}

// readWhenReady reads with an upstream transformer whose KMS v2 provider primes in the
// background: it retries until the plugin answered or 10 s passed.
func readWhenReady(ctx context.Context, t value.Transformer, data []byte, aad value.Context) ([]byte, bool, error) {
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, stale, err := t.TransformFromStorage(ctx, data, aad)
		if err == nil || time.Now().After(deadline) {
			return out, stale, err
		}
		time.Sleep(20 * time.Millisecond) // polling a foreign component, not a state machine
	}
}
