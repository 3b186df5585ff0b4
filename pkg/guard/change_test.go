package guard

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/testutil"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// guardInventory returns an inventory of secrets taken under cfg's Set with the given
// objects per prefix.
func guardInventory(writePrefix string, counts map[string]int64) *migrate.Inventory {
	ri := migrate.ResourceInventory{Resource: "secrets", KeyPrefix: "/registry/secrets/", WritePrefix: writePrefix}
	for p, n := range counts {
		b := bucketOf(p)
		b.Stale = p != writePrefix
		ri.Buckets = append(ri.Buckets, migrate.Count{Bucket: b, Objects: n})
		ri.Objects += n
	}
	return &migrate.Inventory{TakenAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Resources: []migrate.ResourceInventory{ri}}
}

func TestCheckChange(t *testing.T) {
	const (
		k1  = "k8s:enc:aesgcm:v1:key1:"
		k2  = "k8s:enc:aesgcm:v1:key2:"
		cbc = "k8s:enc:aescbc:v1:old:"
		kms = "k8s:enc:kms:v2:plug:"
		v1  = "k8s:enc:kms:v1:old:"
	)
	kmsv1YAML := func(endpoint string) string {
		return "      - kms: {name: old, endpoint: '" + endpoint + "'}\n"
	}
	kmsYAML := func(name string) string {
		return "      - kms: {apiVersion: v2, name: " + name + ", endpoint: unix:///tmp/x.sock}\n"
	}
	withKMS := func(name string, providers ...string) string {
		y := enctest.ConfigYAML("secrets", providers...)
		return strings.Replace(y, "    providers:\n", "    providers:\n"+kmsYAML(name), 1)
	}
	cases := []struct {
		name      string
		cur, next string
		inv       *migrate.Inventory
		want      []string // substrings, one per violation; nil = allowed
	}{
		{
			name: "drop a read key that still holds objects",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key2,key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k2, map[string]int64{k1: 8123, k2: 1877}),
			want: []string{`secrets: 8123 objects are stored under aesgcm key "key1"`},
		},
		{
			name: "drop a read key with no objects left",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key2,key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2"),
			inv: guardInventory(k2, map[string]int64{k1: 0, k2: 10000}),
		},
		{
			name: "drop the write key in one step",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k1, map[string]int64{}),
			want: []string{`aesgcm key "key1" (prefix "k8s:enc:aesgcm:v1:key1:") is the key this resource is written with now`},
		},
		{
			name: "same key name, different secret",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key2,key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2,key1=other"),
			inv:  guardInventory(k2, map[string]int64{k1: 5, k2: 5}),
			want: []string{`5 objects are stored under aesgcm key "key1"`},
		},
		{
			name: "move a key to read position and add a new one",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2,key1"),
			inv: guardInventory(k1, map[string]int64{k1: 100}),
		},
		{
			name: "drop identity while plaintext objects remain",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1", "identity"), next: enctest.ConfigYAML("secrets", "aesgcm:key1"),
			inv:  guardInventory(k1, map[string]int64{"": 3, k1: 7}),
			want: []string{"secrets: 3 objects are stored under plaintext (identity)"},
		},
		{
			name: "drop aescbc after migrating to kms, kms kept",
			cur:  withKMS("plug", "aescbc:old"), next: withKMS("plug"),
			inv: guardInventory(kms, map[string]int64{kms: 50, cbc: 0}),
		},
		{
			name: "drop a kms provider that still holds objects",
			cur:  withKMS("plug2", "aesgcm:key1", "identity"), next: strings.Replace(withKMS("plug2", "aesgcm:key1", "identity"), kmsYAML("plug2"), kmsYAML("plug3"), 1),
			inv: func() *migrate.Inventory {
				inv := guardInventory("k8s:enc:kms:v2:plug2:", map[string]int64{})
				inv.Resources[0].Buckets = []migrate.Count{{Bucket: migrate.Bucket{Provider: transformers.ProviderKMSv2, Key: "plug", Prefix: kms, KeyIDHash: "sha256:ab"}, Objects: 4}}
				return inv
			}(),
			want: []string{`kms provider "plug2"`},
		},
		{
			name: "drop a kms v1 provider that still holds objects",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1") + kmsv1YAML("unix:///tmp/v1.sock"), next: enctest.ConfigYAML("secrets", "aesgcm:key1"),
			inv:  guardInventory(k1, map[string]int64{v1: 12, k1: 3}),
			want: []string{`secrets: 12 objects are stored under kms v1 provider "old"`},
		},
		{
			name: "drop a kms v1 provider after its values were migrated",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1") + kmsv1YAML("unix:///tmp/v1.sock"), next: enctest.ConfigYAML("secrets", "aesgcm:key1"),
			inv: guardInventory(k1, map[string]int64{v1: 0, k1: 15}),
		},
		{
			// KMS v1 has no key id: another endpoint may be a plugin with another key.
			name: "move a kms v1 provider to another endpoint while it holds objects",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1") + kmsv1YAML("unix:///tmp/v1.sock"), next: enctest.ConfigYAML("secrets", "aesgcm:key1") + kmsv1YAML("unix:///tmp/elsewhere.sock"),
			inv:  guardInventory(k1, map[string]int64{v1: 4, k1: 1}),
			want: []string{`4 objects are stored under kms v1 provider "old"`},
		},
		{
			name: "kms v1 provider kept at its endpoint",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1") + kmsv1YAML("unix:///tmp/v1.sock"), next: enctest.ConfigYAML("secrets", "aesgcm:key2,key1") + kmsv1YAML("unix:///tmp/v1.sock"),
			inv: guardInventory(k1, map[string]int64{v1: 4, k1: 1}),
		},
		{
			name: "no inventory: every dropped key is refused",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key2,key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2"),
			want: []string{`aesgcm key "key1" (prefix "k8s:enc:aesgcm:v1:key1:") may still hold objects: no current inventory`},
		},
		{
			name: "inventory taken under another write key is outdated",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key2,key1"), next: enctest.ConfigYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k1, map[string]int64{k1: 0}),
			want: []string{"no current inventory"},
		},
		{
			name: "remove the resource rule entirely",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1"), next: enctest.ConfigYAML("configmaps", "aesgcm:key1"),
			inv: guardInventory(k1, map[string]int64{k1: 9}),
			// configmaps were plaintext (no rule) and next has no identity for them.
			want: []string{"configmaps: plaintext (identity) is the key this resource is written with now", `secrets: 9 objects are stored under aesgcm key "key1"`},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vs := CheckChange(tc.inv, enctest.MustConfig(t, tc.cur), enctest.MustConfig(t, tc.next))
			if len(vs) != len(tc.want) {
				t.Fatalf("violations = %q, want %d", vs, len(tc.want))
			}
			for i, w := range tc.want {
				if !strings.Contains(vs[i].String(), w) {
					t.Errorf("violation %d = %q, want it to contain %q", i, vs[i], w)
				}
			}
		})
	}
}

func TestNewGuardRefusesAndOverrides(t *testing.T) {
	cur := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2,key1"))
	next := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2"))
	store := &migrate.InventoryStore{}
	store.Set(guardInventory("k8s:enc:aesgcm:v1:key2:", map[string]int64{"k8s:enc:aesgcm:v1:key1:": 42}))
	reg := metrics.NewKubeRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	override := false
	guard := New(store, func() bool { return override }, nil, m, testLogger(t))
	err = guard(cur, next)
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("guard = %v, want a refusal", err)
	}
	for _, want := range []string{"test.yaml", next.Hash, "secrets: 42 objects", `aesgcm key "key1"`, "--" + OverrideFlag} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not mention %q", err, want)
		}
	}
	if strings.Contains(err.Error(), enctest.TestKey("aesgcmkey1", 32)) {
		t.Fatal("the refusal contains key material")
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader(storageRefusals(1, 0)), "rekey_storage_guard_refusals_total"); err != nil {
		t.Error(err)
	}
	override = true
	if err := guard(cur, next); err != nil {
		t.Fatalf("with the override: %v", err)
	}
	// After a migration the inventory is empty for key1 and the change passes.
	store.Set(guardInventory("k8s:enc:aesgcm:v1:key2:", map[string]int64{"k8s:enc:aesgcm:v1:key2:": 42}))
	override = false
	if err := guard(cur, next); err != nil {
		t.Fatalf("after migration: %v", err)
	}
}

// rulesYAML joins the rules of several one-rule configurations (enctest.ConfigYAML)
// into one configuration, in order.
func rulesYAML(rules ...string) string {
	const header = "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n"
	var b strings.Builder
	b.WriteString(header)
	for _, r := range rules {
		b.WriteString(strings.TrimPrefix(r, header))
	}
	return b.String()
}

// A new, more specific rule in the next configuration changes what its resources
// resolve to although the current configuration never names them: each is judged,
// with no inventory and with an inventory of the current configuration's resources.
func TestCheckChangeJudgesNewRules(t *testing.T) {
	const k1 = "k8s:enc:aesgcm:v1:key1:"
	wildcard := enctest.ConfigYAML("'*.*'", "aesgcm:key1")
	cases := []struct {
		name      string
		cur, next string
		inv       *migrate.Inventory
		want      string
	}{
		{
			name: "exact rule shadows *.*",
			cur:  wildcard, next: rulesYAML(enctest.ConfigYAML("configmaps", "aesgcm:key2"), wildcard),
			want: `configmaps: aesgcm key "key1"`,
		},
		{
			name: "*.apps shadows *.*",
			cur:  wildcard, next: rulesYAML(enctest.ConfigYAML("'*.apps'", "aesgcm:key2"), wildcard),
			want: `*.apps: aesgcm key "key1"`,
		},
		{
			name: "configmaps encrypted without identity while stored in plaintext",
			cur:  enctest.ConfigYAML("secrets", "aesgcm:key1"), next: rulesYAML(enctest.ConfigYAML("secrets", "aesgcm:key1"), enctest.ConfigYAML("configmaps", "aesgcm:key2")),
			want: "configmaps: plaintext (identity)",
		},
	}
	for _, tc := range cases {
		for _, withInv := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/inventory=%v", tc.name, withInv), func(t *testing.T) {
				var inv *migrate.Inventory
				if withInv {
					// The inventory of what the current configuration names: secrets.
					inv = guardInventory(k1, map[string]int64{k1: 10})
				}
				vs := CheckChange(inv, enctest.MustConfig(t, tc.cur), enctest.MustConfig(t, tc.next))
				found := false
				for _, v := range vs {
					found = found || strings.Contains(v.String(), tc.want)
				}
				if !found {
					t.Fatalf("violations = %q, want one containing %q", vs, tc.want)
				}
			})
		}
	}
	// With an inventory that counts plaintext configmaps the count is named.
	inv := guardInventory(k1, map[string]int64{k1: 10})
	inv.Resources = append(inv.Resources, migrate.ResourceInventory{Resource: "configmaps", KeyPrefix: "/registry/configmaps/", Objects: 7,
		Buckets: []migrate.Count{{Bucket: migrate.Bucket{Provider: transformers.ProviderIdentity, KnownKey: true}, Objects: 7}}})
	vs := CheckChange(inv, enctest.MustConfig(t, cases[2].cur), enctest.MustConfig(t, cases[2].next))
	if len(vs) != 1 || !strings.Contains(vs[0].String(), "configmaps: 7 objects are stored under plaintext (identity)") {
		t.Fatalf("violations = %q, want configmaps' 7 plaintext objects", vs)
	}
	// A next configuration that adds rules and keeps every read path passes.
	ok := rulesYAML(enctest.ConfigYAML("configmaps", "aesgcm:key2,key1"), wildcard)
	if vs := CheckChange(nil, enctest.MustConfig(t, wildcard), enctest.MustConfig(t, ok)); len(vs) != 0 {
		t.Fatalf("keeping key1 as a read key: violations = %q", vs)
	}
}

// New on real stored data across a migration: secrets and configmaps written under
// old keys, a configuration that adds new write keys (one of them KMS v2) and keeps the
// old ones as read keys, and the next one that drops them. Before the migration the
// drop is refused with the inventory's counts; after it, once the verifying re-scan
// has landed in the store, it passes.
func TestNewAcrossAMigration(t *testing.T) {
	const nSecrets, nConfigMaps = 300, 200
	ctx := context.Background()
	cli := startEtcd(t)
	kms := enctest.StartKMS(t, "kek-1")
	twoRules := func(secretProviders, configmapProviders string) string {
		return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" +
			"  - resources: [secrets]\n    providers:\n" + secretProviders +
			"  - resources: [configmaps]\n    providers:\n" + configmapProviders
	}
	s0 := enctest.BuildReady(t, twoRules(enctest.ProviderYAML("aesgcm:g1"), enctest.ProviderYAML("aescbc:c1")), nil)
	writeObjects(t, cli, s0, secrets, nSecrets)
	writeObjects(t, cli, s0, configmaps, nConfigMaps)

	c1 := twoRules(enctest.ProviderYAML("aesgcm:g2,g1"), kms.ProviderYAML("plug")+enctest.ProviderYAML("aescbc:c1"))
	s1 := enctest.BuildReady(t, c1, kms.Factory)
	c2 := twoRules(enctest.ProviderYAML("aesgcm:g2"), kms.ProviderYAML("plug"))
	store := &migrate.InventoryStore{}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(s1), Resources: testResources()})
	if err != nil {
		t.Fatal(err)
	}
	store.Set(inv)
	guard := New(store, nil, nil, nil, testLogger(t))
	err = guard(enctest.MustConfig(t, c1), enctest.MustConfig(t, c2))
	var refused *RefusedError
	if !errors.Is(err, ErrRefused) || !errors.As(err, &refused) || refused.Check != Change {
		t.Fatalf("guard before migration = %v, want a refusal by the change check", err)
	}
	for _, want := range []string{fmt.Sprintf(`secrets: %d objects are stored under aesgcm key "g1"`, nSecrets), fmt.Sprintf(`configmaps: %d objects are stored under aescbc key "c1"`, nConfigMaps)} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not contain %q", err, want)
		}
	}

	if _, err := migrate.Migrate(ctx, migrate.Options{Client: cli, Source: migrate.FromSet(s1), Resources: testResources(), Inventory: store}); err != nil {
		t.Fatal(err)
	}
	if err := guard(enctest.MustConfig(t, c1), enctest.MustConfig(t, c2)); err != nil {
		t.Fatalf("guard after migration: %v", err)
	}
}

// Every check refuses with the one error type, which errors.Is matches whichever
// check refused, and which says what to do in that check's words.
func TestRefusedErrorPerCheck(t *testing.T) {
	v := Violation{Resource: "secrets", Bucket: bucketOf("k8s:enc:aesgcm:v1:key1:"), Objects: 3, Reason: "per the inventory"}
	f := DecryptFailure{Resource: "secrets", Provider: "plug", KeyIDHash: "sha256:ab", Objects: 2, Err: errors.New("wrong key")}
	for _, tc := range []struct {
		err  *RefusedError
		want []string
	}{
		{&RefusedError{Check: Change, Next: `"b.yaml" (h2)`, Violations: []Violation{v}},
			[]string{`refusing encryption configuration "b.yaml" (h2): it cannot read data that is still stored:`, "\n  - secrets: 3 objects", "`rekey migrate`", "--" + OverrideFlag}},
		{&RefusedError{Check: Startup, Next: `"b.yaml" (h2)`, Applied: "a.yaml (h1)", Violations: []Violation{v}},
			[]string{"refusing to start with encryption configuration", "the last applied configuration a.yaml (h1)", "\n  - secrets: 3 objects", "--" + OverrideFlag}},
		{&RefusedError{Check: Decrypt, Next: `"b.yaml" (h2)`, Failures: []DecryptFailure{f}},
			[]string{"a kms provider that keeps its name does not decrypt", `\n  - secrets: 2 objects are stored under kms provider "plug" key id sha256:ab`, "--" + OverrideFlag}},
		{&RefusedError{Check: Cluster, Next: `"b.yaml" (h2)`, Reasons: []string{"secrets: aesgcm/k2 is the write key of apiserver a", "secrets: dropping aesgcm/k1 while the migration runs"}},
			[]string{"it drops keys the cluster still needs:\n  - secrets: aesgcm/k2 is the write key of apiserver a\n  - secrets: dropping aesgcm/k1", "`rekey status`"}},
	} {
		var err error = fmt.Errorf("reload: %w", tc.err)
		if !errors.Is(err, ErrRefused) {
			t.Errorf("%s: errors.Is(%v, ErrRefused) = false", tc.err.Check, err)
		}
		for _, want := range tc.want {
			want = strings.ReplaceAll(want, `\n`, "\n")
			if !strings.Contains(err.Error(), want) {
				t.Errorf("%s: %q does not contain %q", tc.err.Check, err, want)
			}
		}
	}
}

// A write key the cluster's write fence holds back has written nothing: the file that
// drops it (the files of a cluster made to agree after three parallel rotations) is no
// drop of "the key this resource is written with now". The key that really writes, and
// objects counted under any key, still count.
func TestCheckReloadJudgesTheRunningWriter(t *testing.T) {
	const (
		k1 = "k8s:enc:aesgcm:v1:key1:"
		kb = "k8s:enc:aesgcm:v1:key-b:"
	)
	cur := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key-b,key1"))
	next := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key-a,key1"))
	rules := func(writeIndex int) []transformers.RuleInfo {
		return []transformers.RuleInfo{{Resource: "secrets", ReadPrefixes: []string{kb, k1}, WriteIndex: writeIndex}}
	}
	inv := guardInventory(k1, map[string]int64{k1: 40})
	if vs := CheckChange(inv, cur, next); len(vs) == 0 {
		t.Fatal("without the running rules, dropping the configured write key key-b was allowed")
	}
	if vs := CheckReload(inv, cur, next, rules(1)); len(vs) != 0 {
		t.Fatalf("key-b is held (key1 writes): violations %q, want none", vs)
	}
	if vs := CheckReload(inv, cur, next, rules(transformers.NoWriter)); len(vs) != 0 {
		t.Fatalf("writes refused: violations %q, want none", vs)
	}
	if vs := CheckReload(inv, cur, next, rules(0)); len(vs) != 1 || !strings.Contains(vs[0].String(), "written with now") {
		t.Fatalf("key-b writes: violations %q, want the write key refused", vs)
	}
	// The held key's inventory is outdated when the inventory was taken under another
	// writer, and every dropped key is then refused as "may still hold objects".
	if vs := CheckReload(guardInventory(kb, map[string]int64{kb: 3}), cur, next, rules(1)); len(vs) == 0 {
		t.Fatal("an inventory taken under another writer counted as current")
	}
	// A running rule of another read path (another configuration) is ignored.
	other := []transformers.RuleInfo{{Resource: "secrets", ReadPrefixes: []string{k1}, WriteIndex: transformers.NoWriter}}
	if vs := CheckReload(inv, cur, next, other); len(vs) == 0 {
		t.Fatal("the rules of another configuration changed the judgement")
	}
}

// storageRefusals is the exposition of rekey_storage_guard_refusals_total with change
// and decrypt refusals counted (the other checks at 0).
func storageRefusals(change, decrypt int) string {
	return fmt.Sprintf(`# HELP rekey_storage_guard_refusals_total [ALPHA] Configuration changes refused because they would drop a key that still encrypts stored data.
# TYPE rekey_storage_guard_refusals_total counter
rekey_storage_guard_refusals_total{check="backup-retention"} 0
rekey_storage_guard_refusals_total{check="change"} %d
rekey_storage_guard_refusals_total{check="decrypt"} %d
rekey_storage_guard_refusals_total{check="start-up"} 0
`, change, decrypt)
}

// Every guard's refusal is counted here, the cluster guard's included (pkg/layer passes
// its refusals through Count), each under its series name, by check; what is not a
// refusal is not counted.
func TestMetricsCountRefusalsByCheck(t *testing.T) {
	reg := metrics.NewKubeRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	cluster := &RefusedError{Check: Cluster, Reasons: []string{"k2 is the write key of apiserver a"}}
	if err := m.Count(fmt.Errorf("reload: %w", cluster)); !errors.Is(err, cluster) {
		t.Fatalf("Count changed the error: %v", err)
	}
	_ = m.Count(&RefusedError{Check: Decrypt})
	_ = m.Count(errors.New("etcd unavailable"))
	_ = m.Count(nil)
	want := storageRefusals(0, 1) + `# HELP rekey_cluster_guard_refusals_total [ALPHA] Configuration changes refused because they would drop a key another live apiserver still writes with or the cluster's storage migration still needs.
# TYPE rekey_cluster_guard_refusals_total counter
rekey_cluster_guard_refusals_total{check="cluster"} 1
`
	if err := testutil.GatherAndCompare(reg, strings.NewReader(want), "rekey_storage_guard_refusals_total", "rekey_cluster_guard_refusals_total"); err != nil {
		t.Error(err)
	}
	var none *Metrics
	_ = none.Count(cluster) // a nil *Metrics counts nothing
}
