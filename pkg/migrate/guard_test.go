package migrate

import (
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/component-base/metrics/testutil"

	"k8s.io/component-base/metrics"
)

// guardInventory returns an inventory of secrets taken under cfg's Set with the given
// objects per prefix.
func guardInventory(writePrefix string, counts map[string]int64) *Inventory {
	ri := ResourceInventory{Resource: "secrets", KeyPrefix: "/registry/secrets/", WritePrefix: writePrefix}
	for p, n := range counts {
		b := bucketOf(p)
		b.Stale = p != writePrefix
		ri.Buckets = append(ri.Buckets, Count{Bucket: b, Objects: n})
		ri.Objects += n
	}
	return &Inventory{TakenAt: time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC), Resources: []ResourceInventory{ri}}
}

func TestCheckChange(t *testing.T) {
	const (
		k1  = "k8s:enc:aesgcm:v1:key1:"
		k2  = "k8s:enc:aesgcm:v1:key2:"
		cbc = "k8s:enc:aescbc:v1:old:"
		kms = "k8s:enc:kms:v2:plug:"
	)
	kmsYAML := func(name string) string {
		return "      - kms: {apiVersion: v2, name: " + name + ", endpoint: unix:///tmp/x.sock}\n"
	}
	withKMS := func(name string, providers ...string) string {
		y := configYAML("secrets", providers...)
		return strings.Replace(y, "    providers:\n", "    providers:\n"+kmsYAML(name), 1)
	}
	cases := []struct {
		name      string
		cur, next string
		inv       *Inventory
		want      []string // substrings, one per violation; nil = allowed
	}{
		{
			name: "drop a read key that still holds objects",
			cur:  configYAML("secrets", "aesgcm:key2,key1"), next: configYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k2, map[string]int64{k1: 8123, k2: 1877}),
			want: []string{`secrets: 8123 objects are stored under aesgcm key "key1"`},
		},
		{
			name: "drop a read key with no objects left",
			cur:  configYAML("secrets", "aesgcm:key2,key1"), next: configYAML("secrets", "aesgcm:key2"),
			inv: guardInventory(k2, map[string]int64{k1: 0, k2: 10000}),
		},
		{
			name: "drop the write key in one step",
			cur:  configYAML("secrets", "aesgcm:key1"), next: configYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k1, map[string]int64{}),
			want: []string{`aesgcm key "key1" (prefix "k8s:enc:aesgcm:v1:key1:") is the key this resource is written with now`},
		},
		{
			name: "same key name, different secret",
			cur:  configYAML("secrets", "aesgcm:key2,key1"), next: configYAML("secrets", "aesgcm:key2,key1=other"),
			inv:  guardInventory(k2, map[string]int64{k1: 5, k2: 5}),
			want: []string{`5 objects are stored under aesgcm key "key1"`},
		},
		{
			name: "move a key to read position and add a new one",
			cur:  configYAML("secrets", "aesgcm:key1"), next: configYAML("secrets", "aesgcm:key2,key1"),
			inv: guardInventory(k1, map[string]int64{k1: 100}),
		},
		{
			name: "drop identity while plaintext objects remain",
			cur:  configYAML("secrets", "aesgcm:key1", "identity"), next: configYAML("secrets", "aesgcm:key1"),
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
			inv: func() *Inventory {
				inv := guardInventory("k8s:enc:kms:v2:plug2:", map[string]int64{})
				inv.Resources[0].Buckets = []Count{{Bucket: Bucket{Provider: ProviderKMSv2, Key: "plug", Prefix: kms, KeyIDHash: "sha256:ab"}, Objects: 4}}
				return inv
			}(),
			want: []string{`kms provider "plug2"`},
		},
		{
			name: "no inventory: every dropped key is refused",
			cur:  configYAML("secrets", "aesgcm:key2,key1"), next: configYAML("secrets", "aesgcm:key2"),
			want: []string{`aesgcm key "key1" (prefix "k8s:enc:aesgcm:v1:key1:") may still hold objects: no current inventory`},
		},
		{
			name: "inventory taken under another write key is outdated",
			cur:  configYAML("secrets", "aesgcm:key2,key1"), next: configYAML("secrets", "aesgcm:key2"),
			inv:  guardInventory(k1, map[string]int64{k1: 0}),
			want: []string{"no current inventory"},
		},
		{
			name: "remove the resource rule entirely",
			cur:  configYAML("secrets", "aesgcm:key1"), next: configYAML("configmaps", "aesgcm:key1"),
			inv: guardInventory(k1, map[string]int64{k1: 9}),
			// configmaps were plaintext (no rule) and next has no identity for them.
			want: []string{"configmaps: plaintext (identity) is the key this resource is written with now", `secrets: 9 objects are stored under aesgcm key "key1"`},
		},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			vs := CheckChange(tc.inv, mustConfig(t, tc.cur), mustConfig(t, tc.next))
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
	cur := mustConfig(t, configYAML("secrets", "aesgcm:key2,key1"))
	next := mustConfig(t, configYAML("secrets", "aesgcm:key2"))
	store := &InventoryStore{}
	store.Set(guardInventory("k8s:enc:aesgcm:v1:key2:", map[string]int64{"k8s:enc:aesgcm:v1:key1:": 42}))
	reg := metrics.NewKubeRegistry()
	m, err := NewMetrics(reg)
	if err != nil {
		t.Fatal(err)
	}
	override := false
	guard := NewGuard(store, func() bool { return override }, m, testLogger(t))
	err = guard(cur, next)
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("guard = %v, want a refusal", err)
	}
	for _, want := range []string{"test.yaml", next.Hash, "secrets: 42 objects", `aesgcm key "key1"`, "--" + OverrideFlag} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not mention %q", err, want)
		}
	}
	if strings.Contains(err.Error(), testKey("aesgcmkey1", 32)) {
		t.Fatal("the refusal contains key material")
	}
	if err := testutil.GatherAndCompare(reg, strings.NewReader("# HELP rekey_storage_guard_refusals_total [ALPHA] Configuration changes refused because they would drop a key that still encrypts stored data.\n# TYPE rekey_storage_guard_refusals_total counter\nrekey_storage_guard_refusals_total 1\n"), "rekey_storage_guard_refusals_total"); err != nil {
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

// rulesYAML joins the rules of several one-rule configurations (configYAML) into one
// configuration, in order.
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
	wildcard := configYAML("'*.*'", "aesgcm:key1")
	cases := []struct {
		name      string
		cur, next string
		inv       *Inventory
		want      string
	}{
		{
			name: "exact rule shadows *.*",
			cur:  wildcard, next: rulesYAML(configYAML("configmaps", "aesgcm:key2"), wildcard),
			want: `configmaps: aesgcm key "key1"`,
		},
		{
			name: "*.apps shadows *.*",
			cur:  wildcard, next: rulesYAML(configYAML("'*.apps'", "aesgcm:key2"), wildcard),
			want: `*.apps: aesgcm key "key1"`,
		},
		{
			name: "configmaps encrypted without identity while stored in plaintext",
			cur:  configYAML("secrets", "aesgcm:key1"), next: rulesYAML(configYAML("secrets", "aesgcm:key1"), configYAML("configmaps", "aesgcm:key2")),
			want: "configmaps: plaintext (identity)",
		},
	}
	for _, tc := range cases {
		for _, withInv := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/inventory=%v", tc.name, withInv), func(t *testing.T) {
				var inv *Inventory
				if withInv {
					// The inventory of what the current configuration names: secrets.
					inv = guardInventory(k1, map[string]int64{k1: 10})
				}
				vs := CheckChange(inv, mustConfig(t, tc.cur), mustConfig(t, tc.next))
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
	inv.Resources = append(inv.Resources, ResourceInventory{Resource: "configmaps", KeyPrefix: "/registry/configmaps/", Objects: 7,
		Buckets: []Count{{Bucket: Bucket{Provider: ProviderIdentity, KnownKey: true}, Objects: 7}}})
	vs := CheckChange(inv, mustConfig(t, cases[2].cur), mustConfig(t, cases[2].next))
	if len(vs) != 1 || !strings.Contains(vs[0].String(), "configmaps: 7 objects are stored under plaintext (identity)") {
		t.Fatalf("violations = %q, want configmaps' 7 plaintext objects", vs)
	}
	// A next configuration that adds rules and keeps every read path passes.
	ok := rulesYAML(configYAML("configmaps", "aesgcm:key2,key1"), wildcard)
	if vs := CheckChange(nil, mustConfig(t, wildcard), mustConfig(t, ok)); len(vs) != 0 {
		t.Fatalf("keeping key1 as a read key: violations = %q", vs)
	}
}
