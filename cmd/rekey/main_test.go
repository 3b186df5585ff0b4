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

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
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

func seed(t *testing.T, cli *clientv3.Client, cfgPath string, n int) {
	t.Helper()
	cfg, err := config.Load(cfgPath, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	tr := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	// A stored object in kube-apiserver's protobuf envelope: migration rewrites nothing else.
	u := runtime.Unknown{TypeMeta: runtime.TypeMeta{APIVersion: "v1", Kind: "Secret"}, Raw: []byte("payload")}
	raw, err := u.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	obj := append([]byte("k8s\x00"), raw...)
	for i := 0; i < n; i++ {
		key := fmt.Sprintf("/registry/secrets/ns/s%04d", i)
		out, err := tr.TransformToStorage(context.Background(), obj, value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(context.Background(), key, string(out)); err != nil {
			t.Fatal(err)
		}
	}
}
