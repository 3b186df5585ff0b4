package transformers_test

import (
	"context"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// buildCounted builds yaml into a Set that counts its writes in counts.
func buildCounted(t testing.TB, yaml string, counts *transformers.WriteCounts) *transformers.Set {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml), "config.yaml", config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{WriteCounts: counts})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	return set
}

func writeN(t *testing.T, tr value.Transformer, n int) {
	t.Helper()
	for range n {
		if _, err := tr.TransformToStorage(context.Background(), []byte("v"), value.DefaultContext("/registry/secrets/ns/s")); err != nil {
			t.Fatal(err)
		}
	}
}

// writesOf is the count of the key named name of provider, 0 when not counted.
func writesOf(counts *transformers.WriteCounts, provider, name string) (uint64, int) {
	var n uint64
	found := 0
	for _, k := range counts.Snapshot() {
		if k.Provider == provider && k.Key == name {
			n += k.Writes
			found++
		}
	}
	return n, found
}

// A Set rebuilt from the same configuration (a reload) continues the count of each
// key; a read-only key is listed with no writes; a different secret under the same
// name is another key; identity is not counted.
func TestWriteCountsSurviveARebuiltSet(t *testing.T) {
	counts := transformers.NewWriteCounts()
	first := buildCounted(t, configFor("secrets", "aesgcm", "identity"), counts)
	writeN(t, first.TransformerFor(secrets), 3)
	second := buildCounted(t, configFor("secrets", "aesgcm", "identity"), counts)
	writeN(t, second.TransformerFor(secrets), 4)
	if n, found := writesOf(counts, transformers.ProviderAESGCM, "key1"); n != 7 || found != 1 {
		t.Fatalf("aesgcm/key1 after a reload: %d writes in %d counters, want 7 in 1", n, found)
	}
	if n, found := writesOf(counts, transformers.ProviderAESGCM, "key2"); n != 0 || found != 1 {
		t.Fatalf("aesgcm/key2 (read only): %d writes in %d counters, want 0 in 1", n, found)
	}
	if _, found := writesOf(counts, transformers.ProviderIdentity, ""); found != 0 {
		t.Fatal("identity is counted; it has no key to wear out")
	}
	// aescbc-other is another secret under the name key1 of another provider; its
	// own counter starts at zero.
	other := buildCounted(t, configFor("secrets", "aescbc-other"), counts)
	writeN(t, other.TransformerFor(secrets), 2)
	if n, found := writesOf(counts, transformers.ProviderAESCBC, "key1"); n != 2 || found != 1 {
		t.Fatalf("aescbc/key1: %d writes in %d counters, want 2 in 1", n, found)
	}
}

// The key a write fence chooses is the one counted, and refused writes count nothing.
func TestWriteCountsFollowTheWriteFence(t *testing.T) {
	counts := transformers.NewWriteCounts()
	set := buildCounted(t, configFor("secrets", "aesgcm"), counts)
	held, err := set.WithWriters(map[string]transformers.Writer{"secrets": {Index: 1}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(held.Close)
	writeN(t, held.TransformerFor(secrets), 5)
	refused, err := set.WithWriters(map[string]transformers.Writer{"secrets": {Refuse: "no"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(refused.Close)
	if _, err := refused.TransformerFor(secrets).TransformToStorage(context.Background(), []byte("v"), value.DefaultContext("/k")); err == nil {
		t.Fatal("a refused write succeeded")
	}
	if n, _ := writesOf(counts, transformers.ProviderAESGCM, "key2"); n != 5 {
		t.Fatalf("aesgcm/key2 (the fence's writer): %d writes, want 5", n)
	}
	if n, _ := writesOf(counts, transformers.ProviderAESGCM, "key1"); n != 0 {
		t.Fatalf("aesgcm/key1 (held back): %d writes, want 0", n)
	}
}
