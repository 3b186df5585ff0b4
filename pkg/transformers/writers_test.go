package transformers_test

import (
	"bytes"
	"context"
	"errors"
	"reflect"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestWithWritersWritesWithTheChosenEntry derives a Set whose secrets rule writes with
// its second key: new values carry that key's prefix, both Sets read each other's
// values, and the stale flag stays relative to the configuration's first key.
func TestWithWritersWritesWithTheChosenEntry(t *testing.T) {
	base := loadOurs(t, "aesgcm", configFor(`"secrets"`, "aesgcm"))
	held, err := base.WithWriters(map[string]transformers.Writer{"secrets": {Index: 1}})
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
	base := loadOurs(t, "aesgcm", configFor(`"secrets"`, "aesgcm"))
	for _, w := range []map[string]transformers.Writer{{"configmaps": {Index: 1}}, {"secrets": {Index: 2}}, {"secrets": {Index: -1}}} {
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

// TestWithWritersRefusal derives a Set whose secrets rule refuses writes: writes fail
// with a ServiceUnavailable status naming why, reads still work, and the rule reports
// no writer.
func TestWithWritersRefusal(t *testing.T) {
	base := loadOurs(t, "aesgcm", configFor(`"secrets"`, "aesgcm"))
	ctx := context.Background()
	dataCtx := value.DefaultContext("/registry/secrets/ns/s1")
	stored, err := base.TransformerFor(secrets).TransformToStorage(ctx, []byte("v"), dataCtx)
	if err != nil {
		t.Fatal(err)
	}
	const why = "this apiserver cannot read aesgcm/k2, the key the other apiservers write secrets with"
	refusing, err := base.WithWriters(map[string]transformers.Writer{"secrets": {Refuse: why}})
	if err != nil {
		t.Fatal(err)
	}
	defer refusing.Close()
	_, err = refusing.TransformerFor(secrets).TransformToStorage(ctx, []byte("w"), dataCtx)
	if !apierrors.IsServiceUnavailable(err) || !strings.Contains(err.Error(), why) {
		t.Fatalf("write while refused: %v, want ServiceUnavailable naming %q", err, why)
	}
	// The etcd3 store wraps every transformer error; the refusal must be found under it.
	var refused *transformers.WriteRefusedError
	if !errors.As(storage.NewInternalError(err), &refused) || refused.Reason != why {
		t.Fatalf("write while refused: %v, want a *transformers.WriteRefusedError found under storage.InternalError", err)
	}
	if plain, _, err := refusing.TransformerFor(secrets).TransformFromStorage(ctx, stored, dataCtx); err != nil || string(plain) != "v" {
		t.Fatalf("read while refused = %q, %v; want v", plain, err)
	}
	info := refusing.Rules()[0]
	if _, ok := info.Writer(); ok || info.WriteIndex != transformers.NoWriter || info.WriteRefused != why {
		t.Fatalf("refusing rule info = %+v, want no writer and the reason", info)
	}
	// A refusal that lasts until a configuration edit carries no Retry-After.
	if st := refused.Status(); st.Details != nil && st.Details.RetryAfterSeconds != 0 {
		t.Fatalf("refusal without RetryAfter answers Retry-After %d", st.Details.RetryAfterSeconds)
	}

	// One that ends on its own does: the REST layer turns it into the Retry-After header.
	waiting, err := base.WithWriters(map[string]transformers.Writer{"secrets": {Refuse: why, RetryAfter: 2 * time.Second}})
	if err != nil {
		t.Fatal(err)
	}
	defer waiting.Close()
	_, err = waiting.TransformerFor(secrets).TransformToStorage(ctx, []byte("w"), dataCtx)
	if !errors.As(err, &refused) {
		t.Fatalf("write while refused: %v, want a *transformers.WriteRefusedError", err)
	}
	if st := refused.Status(); st.Code != 503 || st.Details == nil || st.Details.RetryAfterSeconds != 2 {
		t.Fatalf("refusal with RetryAfter 2s answers %+v, want 503 with Retry-After 2", st)
	}
}

// TestCheckValues: a running Set and DescribeRules publish the same check value for
// a key, a key of the same name with another secret gets another one, and Match tells
// the cases apart.
func TestCheckValues(t *testing.T) {
	cfgFor := func(secret string) *config.Config {
		return parseSecretsRule(t, `
  - aesgcm:
      keys:
      - name: k1
        secret: `+secret+`
  - identity: {}
`)
	}
	a := cfgFor("MTIzNDU2Nzg5MDEyMzQ1Ng==")
	b := cfgFor("YWJjZGVmZ2hpamtsbW5vcA==")
	set, err := transformers.Build(context.Background(), a, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	built, described := set.Rules()[0].ReadKeys[0], transformers.DescribeRules(a)[0].ReadKeys[0]
	other := transformers.DescribeRules(b)[0].ReadKeys[0]
	if built.Check == "" || built != described {
		t.Fatalf("built %+v, described %+v: want equal, with a check value", built, described)
	}
	if len(built.Check) != 16 || strings.Contains(built.Check, "MTIz") {
		t.Fatalf("check value %q: want 16 hex characters, nothing of the secret", built.Check)
	}
	legacy := transformers.KeyInfo{Provider: "aesgcm", Key: "k1"}
	for _, c := range []struct {
		a, b transformers.KeyInfo
		want transformers.KeyMatch
	}{
		{built, described, transformers.KeysSame},
		{built, other, transformers.KeysConflict},
		{built, legacy, transformers.KeysUnverified},
		{built, transformers.KeyInfo{Provider: "aesgcm", Key: "k2", Check: built.Check}, transformers.KeysDiffer},
		{transformers.KeyInfo{Provider: "kms", Key: "v", KeyIDHash: "h1"}, transformers.KeyInfo{Provider: "kms", Key: "v", KeyIDHash: "h2"}, transformers.KeysSame},
		{transformers.KeyInfo{Provider: "identity"}, transformers.KeyInfo{Provider: "identity"}, transformers.KeysSame},
	} {
		if got := c.a.Match(c.b); got != c.want {
			t.Errorf("%+v.Match(%+v) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
	if id := set.Rules()[0].ReadKeys[1]; id.Check != "" {
		t.Errorf("identity has check value %q", id.Check)
	}
}

// TestKMSv1Identity: a KMS v1 provider is described as a running Set reports it, read
// only and never the writer, and identified by name and endpoint (it has no key id).
func TestKMSv1Identity(t *testing.T) {
	cfgFor := func(endpoint string) *config.Config {
		return parseSecretsRule(t, `
  - aesgcm:
      keys:
      - {name: k1, secret: MTIzNDU2Nzg5MDEyMzQ1Ng==}
  - kms: {name: old, endpoint: "`+endpoint+`"}
`)
	}
	a := cfgFor("unix:///tmp/kmsv1-a.sock")
	set, err := transformers.Build(context.Background(), a, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	built, described := set.Rules(), transformers.DescribeRules(a)
	if !reflect.DeepEqual(built, described) {
		t.Fatalf("Set.Rules %+v\nDescribeRules %+v", built, described)
	}
	v1 := built[0].ReadKeys[1]
	if v1.Provider != transformers.ProviderKMSv1 || v1.Key != "old" || v1.Check == "" || built[0].ReadPrefixes[1] != "k8s:enc:kms:v1:old:" {
		t.Fatalf("KMS v1 entry %+v, prefix %q", v1, built[0].ReadPrefixes[1])
	}
	if w, _ := built[0].Writer(); w.Provider != transformers.ProviderAESGCM {
		t.Fatalf("writer %+v", w)
	}
	moved := transformers.DescribeRules(cfgFor("unix:///tmp/kmsv1-b.sock"))[0].ReadKeys[1]
	for _, c := range []struct {
		a, b transformers.KeyInfo
		want transformers.KeyMatch
	}{
		{v1, described[0].ReadKeys[1], transformers.KeysSame},
		{v1, moved, transformers.KeysConflict},
		{v1, transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "old"}, transformers.KeysDiffer},
	} {
		if got := c.a.Match(c.b); got != c.want {
			t.Errorf("%+v.Match(%+v) = %d, want %d", c.a, c.b, got, c.want)
		}
	}
	if p, k := transformers.SplitPrefix("k8s:enc:kms:v1:old:"); p != transformers.ProviderKMSv1 || k != "old" {
		t.Errorf("SplitPrefix = %s, %s", p, k)
	}
}

// parseSecretsRule parses a configuration with one rule for secrets whose providers
// are providers (YAML list items, indented by two spaces).
func parseSecretsRule(t *testing.T, providers string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [\"secrets\"]\n  providers:"+providers), "test", config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}
