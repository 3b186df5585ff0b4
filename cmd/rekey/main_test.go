package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

func secret(seed byte) string {
	k := make([]byte, 32)
	for i := range k {
		k[i] = seed + byte(i)
	}
	return base64.StdEncoding.EncodeToString(k)
}

func writeConfig(t *testing.T, name string, keys ...string) string {
	t.Helper()
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n")
	for _, k := range keys {
		fmt.Fprintf(&b, "            - {name: %s, secret: %s}\n", k, secret(k[len(k)-1]))
	}
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

func run(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCommand()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.ExecuteContext(context.Background())
	return out.String(), err
}

func TestInventoryMigrateCheckConfig(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	oldCfg := writeConfig(t, "old.yaml", "key1")
	midCfg := writeConfig(t, "mid.yaml", "key2", "key1")
	newCfg := writeConfig(t, "new.yaml", "key2")
	seed(t, cli, oldCfg, 120)
	etcd := []string{"--etcd-servers", srv.Endpoint}

	// The one-step swap key1 → key2 is refused.
	out, err := run(t, append([]string{"check-config", "--encryption-provider-config", oldCfg, "--new", newCfg}, etcd...)...)
	if err == nil || !strings.Contains(err.Error(), `secrets: 120 objects are stored under aesgcm key "key1"`) {
		t.Fatalf("check-config old→new: err = %v, out %s", err, out)
	}
	// Adding key2 as the write key and keeping key1 is fine.
	if out, err := run(t, append([]string{"check-config", "--encryption-provider-config", oldCfg, "--new", midCfg}, etcd...)...); err != nil || !strings.Contains(out, "OK:") {
		t.Fatalf("check-config old→mid: %v\n%s", err, out)
	}

	out, err = run(t, append([]string{"inventory", "--encryption-provider-config", midCfg, "-o", "json"}, etcd...)...)
	if err != nil {
		t.Fatal(err)
	}
	var inv migrate.Inventory
	if err := json.Unmarshal([]byte(out), &inv); err != nil {
		t.Fatalf("inventory -o json: %v\n%s", err, out)
	}
	if s := inv.Find("secrets"); s == nil || s.Objects != 120 || s.Stale != 120 {
		t.Fatalf("inventory = %+v, want 120 stale secrets", s)
	}
	if strings.Contains(out, secret('1')) {
		t.Fatal("inventory output contains key material")
	}

	ckpt := filepath.Join(t.TempDir(), "ckpt.json")
	out, err = run(t, append([]string{"migrate", "--encryption-provider-config", midCfg, "--checkpoint", ckpt, "--progress", "lines"}, etcd...)...)
	if err != nil || !strings.Contains(out, "rewritten 120") || !strings.Contains(out, "verified:") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}

	out, err = run(t, append([]string{"inventory", "--encryption-provider-config", midCfg, "--decrypt-check"}, etcd...)...)
	if err != nil || !strings.Contains(out, "secrets: 120 objects") || !strings.Contains(out, "0 stale") || !strings.Contains(out, "key2") {
		t.Fatalf("inventory table after migrate: %v\n%s", err, out)
	}
	// Now key1 holds nothing and mid → new passes.
	if out, err := run(t, append([]string{"check-config", "--encryption-provider-config", midCfg, "--new", newCfg}, etcd...)...); err != nil {
		t.Fatalf("check-config mid→new after migration: %v\n%s", err, out)
	}
}

// check-config judges rules that only the new configuration has: an exact rule or a
// *.apps rule shadowing *.*'s key, and configmaps encrypted with no identity fallback
// while they are stored in plaintext. It inventories what the new configuration names.
func TestCheckConfigJudgesNewRules(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	dir := t.TempDir()
	write := func(name, body string) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n"+body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	rule := func(resource, key string) string {
		return fmt.Sprintf("  - resources: [%q]\n    providers:\n      - aesgcm:\n          keys: [{name: %s, secret: %s}]\n", resource, key, secret(key[len(key)-1]))
	}
	wildcard := write("wildcard.yaml", rule("*.*", "key1"))
	secretsOnly := write("secrets.yaml", rule("secrets", "key1"))
	// Three configmaps encrypted with key1 under *.*, and four in plaintext (which
	// secretsOnly reads: it has no rule for configmaps).
	seedResource(t, cli, wildcard, "configmaps", "enc", 3)
	// Five widgets, which no default scan covers, encrypted with key1 under *.*.
	seedResource(t, cli, wildcard, "example.com/widgets", "enc", 5)
	seedPlain(t, cli, "configmaps", "plain", 4)

	cases := []struct {
		name, cur, next string
		want            string
	}{
		{"exact rule shadows *.*", wildcard, write("exact.yaml", rule("widgets.example.com", "key2")+rule("*.*", "key1")), `widgets.example.com: 5 objects are stored under aesgcm key "key1"`},
		{"*.apps shadows *.*", wildcard, write("apps.yaml", rule("*.apps", "key2")+rule("*.*", "key1")), `*.apps: aesgcm key "key1"`},
		{"configmaps without identity", secretsOnly, write("cm.yaml", rule("secrets", "key1")+rule("configmaps", "key2")), "configmaps: 4 objects are stored under plaintext (identity)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			out, err := run(t, append([]string{"check-config", "--encryption-provider-config", tc.cur, "--new", tc.next}, etcd...)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("check-config: err = %v, want it to contain %q; out %s", err, tc.want, out)
			}
		})
	}
}

// loadSet builds the transformers of the configuration at cfgPath; the test closes them.
func loadSet(t *testing.T, cfgPath string) *transformers.Set {
	t.Helper()
	cfg, err := config.Load(cfgPath, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	return set
}

func seedResource(t *testing.T, cli *clientv3.Client, cfgPath, resource, ns string, n int) {
	t.Helper()
	set := loadSet(t, cfgPath)
	group, res, ok := strings.Cut(resource, "/")
	if !ok {
		group, res = "", resource
	}
	tr := set.TransformerFor(schema.GroupResource{Group: group, Resource: res})
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("/registry/%s/%s/o%04d", resource, ns, i)
		out, err := tr.TransformToStorage(context.Background(), []byte("k8s\x00payload"), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(context.Background(), key, string(out)); err != nil {
			t.Fatal(err)
		}
	}
}

func seedPlain(t *testing.T, cli *clientv3.Client, resource, ns string, n int) {
	t.Helper()
	for i := 0; i < n; i++ {
		if _, err := cli.Put(context.Background(), fmt.Sprintf("/registry/%s/%s/o%04d", resource, ns, i), "k8s\x00payload"); err != nil {
			t.Fatal(err)
		}
	}
}

// check-config decrypts one stored object per KMS key id with the new configuration: a
// provider that keeps its name but reaches a plugin with another keyring fails, the
// same keyring at a new socket passes.
func TestCheckConfigKMSKeyring(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	dir, err := os.MkdirTemp("", "cc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	keys := func(name string, seed byte) string {
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte("keys:\n- {name: kek1, secret: "+secret(seed)+"}\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	keysA, keysB := keys("a.yaml", 'a'), keys("b.yaml", 'b')
	plugin := func(name, keysFile string) string {
		endpoint := "unix://" + filepath.Join(dir, name+".sock")
		s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: endpoint, KeysFile: keysFile})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		return endpoint
	}
	cfg := func(name, endpoint string) string {
		path := filepath.Join(dir, name)
		body := fmt.Sprintf("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - kms: {apiVersion: v2, name: plug, endpoint: %q, timeout: 3s}\n", endpoint)
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	cur := cfg("cur.yaml", plugin("a", keysA))
	other := cfg("other.yaml", plugin("b", keysB))
	moved := cfg("moved.yaml", plugin("c", keysA))

	curCfg, err := config.Load(cur, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(context.Background(), curCfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{})})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	wctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	if err := set.KMSProviders()[0].WaitReady(wctx); err != nil {
		t.Fatal(err)
	}
	tr := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	for i := range 4 {
		key := fmt.Sprintf("/registry/secrets/ns/k%d", i)
		out, err := tr.TransformToStorage(context.Background(), []byte("k8s\x00payload"), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(context.Background(), key, string(out)); err != nil {
			t.Fatal(err)
		}
	}

	out, err := run(t, append([]string{"check-config", "--encryption-provider-config", cur, "--new", other}, etcd...)...)
	if err == nil || !strings.Contains(err.Error(), `secrets: 4 objects are stored under kms provider "plug" key id sha256:`) || !strings.Contains(err.Error(), "cannot decrypt") {
		t.Fatalf("check-config to another keyring: err = %v, out %s", err, out)
	}
	if out, err := run(t, append([]string{"check-config", "--encryption-provider-config", cur, "--new", moved}, etcd...)...); err != nil || !strings.Contains(out, "OK:") {
		t.Fatalf("check-config to the same keyring at a new socket: %v\n%s", err, out)
	}
}

// With "encrypt everything" (*.*), every command covers every stored resource — not
// only secrets and configmaps: check-config counts Deployments (at kube's path) and
// custom resources under the old key, migrate moves them all, and then the old key may
// go.
func TestWildcardCoversEveryStoredResource(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	dir := t.TempDir()
	write := func(name string, keys ...string) string {
		body := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [\"*.*\"]\n    providers:\n      - aesgcm:\n          keys:\n"
		for _, k := range keys {
			body += fmt.Sprintf("            - {name: %s, secret: %s}\n", k, secret(k[len(k)-1]))
		}
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	old, both, next := write("old.yaml", "key1"), write("both.yaml", "key2", "key1"), write("next.yaml", "key2")
	cfg, err := config.Load(old, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set := enctest.MustSet(t, cfg)
	enctest.WriteObjects(t, cli, set, schema.GroupResource{Resource: "secrets"}, "/registry/secrets/", 4)
	enctest.WriteObjects(t, cli, set, schema.GroupResource{Group: "apps", Resource: "deployments"}, "/registry/deployments/", 6)
	enctest.WriteObjects(t, cli, set, schema.GroupResource{Group: "example.com", Resource: "widgets"}, "/registry/example.com/widgets/", 5)

	_, err = run(t, append([]string{"check-config", "--encryption-provider-config", both, "--new", next}, etcd...)...)
	for _, want := range []string{`deployments.apps: 6 objects are stored under aesgcm key "key1"`, `widgets.example.com: 5 objects`, `secrets: 4 objects`} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Fatalf("check-config before the migration: err = %v, want it to contain %q", err, want)
		}
	}
	out, err := run(t, append([]string{"migrate", "--encryption-provider-config", both, "--progress", "none"}, etcd...)...)
	if err != nil || !strings.Contains(out, "rewritten 15") || !strings.Contains(out, "verified") {
		t.Fatalf("migrate: %v\n%s", err, out)
	}
	out, err = run(t, append([]string{"inventory", "--encryption-provider-config", both, "--decrypt-check"}, etcd...)...)
	if err != nil || !strings.Contains(out, "deployments.apps") || !strings.Contains(out, "widgets.example.com") || strings.Contains(out, "key1") {
		t.Fatalf("inventory after the migration: %v\n%s", err, out)
	}
	if out, err := run(t, append([]string{"check-config", "--encryption-provider-config", both, "--new", next}, etcd...)...); err != nil {
		t.Fatalf("check-config after the migration: %v\n%s", err, out)
	}
}
