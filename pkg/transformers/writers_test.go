package transformers_test

import (
	"bytes"
	"context"
	"strings"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"
)

// TestWithWritersWritesWithTheChosenEntry derives a Set whose secrets rule writes with
// its second key: new values carry that key's prefix, both Sets read each other's
// values, and the stale flag stays relative to the configuration's first key.
func TestWithWritersWritesWithTheChosenEntry(t *testing.T) {
	base := loadPair(t, "aesgcm", configFor(`"secrets"`, "aesgcm")).ours
	held, err := base.WithWriters(map[string]int{"secrets": 1})
	if err != nil {
		t.Fatal(err)
	}
	defer held.Close()
	ctx := context.Background()
	dataCtx := value.DefaultContext("/registry/secrets/ns/s1")

	out, err := held.TransformerFor(secrets).TransformToStorage(ctx, []byte("v"), dataCtx)
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.HasPrefix(out, []byte("k8s:enc:aesgcm:v1:key2:")) {
		t.Fatalf("derived Set wrote %q, want the second key's prefix", out[:min(len(out), 24)])
	}
	plain, stale, err := base.TransformerFor(secrets).TransformFromStorage(ctx, out, dataCtx)
	if err != nil || string(plain) != "v" || !stale {
		t.Fatalf("base Set read of the held write = %q, stale %v, err %v; want v, stale (not the config's first key)", plain, stale, err)
	}
	first, err := base.TransformerFor(secrets).TransformToStorage(ctx, []byte("w"), dataCtx)
	if err != nil {
		t.Fatal(err)
	}
	if _, stale, err := held.TransformerFor(secrets).TransformFromStorage(ctx, first, dataCtx); err != nil || stale {
		t.Fatalf("derived Set read of a first-key value: stale %v, err %v; want not stale (it is the config's first key)", stale, err)
	}

	info := held.Rules()[0]
	if info.WriteIndex != 1 || info.WriteKey != "key2" || info.WritePrefix != "k8s:enc:aesgcm:v1:key2:" {
		t.Fatalf("derived rule info = %+v, want writer index 1, key2", info)
	}
	if len(info.ReadKeys) != 2 || info.ReadKeys[0].Key != "key1" || info.ReadKeys[1].Key != "key2" {
		t.Fatalf("ReadKeys = %v, want key1, key2 in config order", info.ReadKeys)
	}
	if b := base.Rules()[0]; b.WriteIndex != 0 || b.WriteKey != "key1" {
		t.Fatalf("base rule info changed: %+v", b)
	}
}

func TestWithWritersRefusesUnknownRuleOrIndex(t *testing.T) {
	base := loadPair(t, "aesgcm", configFor(`"secrets"`, "aesgcm")).ours
	for _, w := range []map[string]int{{"configmaps": 1}, {"secrets": 2}, {"secrets": -1}} {
		if s, err := base.WithWriters(w); err == nil {
			s.Close()
			t.Errorf("WithWriters(%v) succeeded, want an error", w)
		}
	}
	base.Close()
	if _, err := base.WithWriters(nil); err == nil || !strings.Contains(err.Error(), "closed") {
		t.Errorf("WithWriters on a closed Set: %v, want a closed error", err)
	}
}
