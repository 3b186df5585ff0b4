package transformers_test

import (
	"bytes"
	"context"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// cbcReads reads rekey_storage_transformation_cbc_reads_total{resource=secrets,
// transformer_prefix=prefix, status=status} from reg (0 when absent).
func cbcReads(t *testing.T, reg metrics.KubeRegistry, prefix, status string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != "rekey_storage_transformation_cbc_reads_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			if labels["resource"] == "secrets" && labels["transformer_prefix"] == prefix && labels["status"] == status {
				return m.GetCounter().GetValue()
			}
		}
	}
	return 0
}

// TestCBCReadsAreCounted: the Set's metrics count every read of an aescbc value and
// every read of a KMS v1 value whose data is AES-CBC (written by Kubernetes 1.24 and
// earlier), apart from their failures; reads of aesgcm values and of KMS v1 values
// with AES-GCM data are not CBC reads. Failures of both carry the one CBC error.
func TestCBCReadsAreCounted(t *testing.T) {
	upstreamKMSv1(t)
	plugin := enctest.StartKMSv1(t, "kek1")
	ctx := context.Background()
	aad := value.DefaultContext("/registry/secrets/ns/name")
	header := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	reg := metrics.NewKubeRegistry()
	m := transformers.NewMetrics(reg)
	cfg := enctest.MustConfig(t, header+compatconfigs.ProviderYAML["aesgcm"]+compatconfigs.ProviderYAML["aescbc"]+kmsv1YAML(plugin, "old"))
	set, err := transformers.Build(ctx, cfg, transformers.Options{Metrics: m})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	reader := set.TransformerFor(secrets)
	cbcOnly, err := transformers.Build(ctx, enctest.MustConfig(t, header+compatconfigs.ProviderYAML["aescbc"]), transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer cbcOnly.Close()
	write := func(tr value.Transformer) []byte {
		t.Helper()
		v, err := tr.TransformToStorage(ctx, []byte("payload of some length"), aad)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	// corrupt flips the bits of the padding length: the value no longer decrypts.
	corrupt := func(v []byte) []byte {
		w := bytes.Clone(v)
		w[len(w)-16-1] ^= 0x80
		return w
	}
	const cbcPrefix, v1Prefix = "k8s:enc:aescbc:v1:", "k8s:enc:kms:v1:old:"
	cbcValue := write(cbcOnly.TransformerFor(secrets))
	v1CBC := write(enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", true))
	v1GCM := write(enctest.UpstreamKMSv1(t, plugin.Endpoint(), "old", false))
	for _, step := range []struct {
		what          string
		value         []byte
		fails         bool
		prefix        string
		okN, failedN  float64
		otherPrefixed float64 // the count of the other CBC prefix, unchanged
	}{
		{"an aesgcm value", write(reader), false, cbcPrefix, 0, 0, 0},
		{"an aescbc value", cbcValue, false, cbcPrefix, 1, 0, 0},
		{"a corrupted aescbc value", corrupt(cbcValue), true, cbcPrefix, 1, 1, 0},
		{"a KMS v1 value with AES-GCM data", v1GCM, false, v1Prefix, 0, 0, 1},
		{"a KMS v1 value with AES-CBC data", v1CBC, false, v1Prefix, 1, 0, 1},
		{"a corrupted KMS v1 value with AES-CBC data", corrupt(v1CBC), true, v1Prefix, 1, 1, 1},
	} {
		_, _, err := reader.TransformFromStorage(ctx, step.value, aad)
		if (err != nil) != step.fails {
			t.Fatalf("%s: read err=%v, want failure %v", step.what, err, step.fails)
		}
		ok, failed := cbcReads(t, reg, step.prefix, "OK"), cbcReads(t, reg, step.prefix, "failed")
		if ok != step.okN || failed != step.failedN {
			t.Fatalf("after %s: CBC reads under %s OK=%v failed=%v, want %v and %v", step.what, step.prefix, ok, failed, step.okN, step.failedN)
		}
		if n := cbcReads(t, reg, cbcPrefix, "OK"); step.prefix != cbcPrefix && n != step.otherPrefixed {
			t.Fatalf("after %s: CBC reads under %s OK=%v, want %v", step.what, cbcPrefix, n, step.otherPrefixed)
		}
	}
}
