package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// TestRotateCommand runs the whole command: the file is replaced with its mode kept,
// -o - leaves it alone, and --remove-old is refused while stored objects still use the
// old key and allowed once they are migrated.
func TestRotateCommand(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	if err := os.Chmod(path, 0o640); err != nil {
		t.Fatal(err)
	}
	seed(t, cli, path, 20)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	orig, _ := os.ReadFile(path)

	out, err := run(t, "rotate", "--encryption-provider-config", path, "-o", "-")
	if err != nil {
		t.Fatal(err)
	}
	if now, _ := os.ReadFile(path); !bytes.Equal(now, orig) {
		t.Fatal("-o - changed the file")
	}
	if _, err := config.Parse([]byte(out[:strings.LastIndex(out, "new write key")]), "stdout", config.Options{Reload: true}); err != nil {
		t.Fatalf("-o - printed no valid configuration: %v\n%s", err, out)
	}

	out, err = run(t, "rotate", "--encryption-provider-config", path)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(path)
	if err != nil || fi.Mode().Perm() != 0o640 {
		t.Fatalf("mode after rotate = %v (%v), want 0640", fi.Mode(), err)
	}
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	keys := cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys
	if len(keys) != 2 || keys[1].Name != "key1" || !strings.HasPrefix(keys[0].Name, "key-") {
		t.Fatalf("keys after rotate = %v names, want [key-… key1]", len(keys))
	}
	if strings.Contains(out, keys[0].Secret) {
		t.Fatal("rotate printed the new key's secret")
	}
	newKey := keys[0].Name

	out, err = run(t, append([]string{"rotate", "--encryption-provider-config", path, "--remove-old", "key1"}, etcd...)...)
	if err == nil || !strings.Contains(err.Error(), "still encrypts stored data") || !strings.Contains(err.Error(), "20 objects") {
		t.Fatalf("early removal: err = %v, out %s", err, out)
	}
	if _, err := run(t, append([]string{"migrate", "--encryption-provider-config", path, "--progress", "none"}, etcd...)...); err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, append([]string{"rotate", "--encryption-provider-config", path, "--remove-old", "key1"}, etcd...)...); err != nil {
		t.Fatalf("removal after migration: %v\n%s", err, out)
	}
	cfg, err = config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	if keys := cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys; len(keys) != 1 || keys[0].Name != newKey {
		t.Fatalf("keys after removal: %d, want only %s", len(keys), newKey)
	}
}

// seed stores n Secrets written with cfgPath's write provider (KMS v2 included;
// identity stores them in plaintext).
func seed(t *testing.T, cli *clientv3.Client, cfgPath string, n int) {
	t.Helper()
	ctx := t.Context()
	cfg, err := config.Load(cfgPath, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{})})
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	for _, p := range set.KMSProviders() {
		wctx, cancel := context.WithTimeout(ctx, 15*time.Second)
		err := p.WaitReady(wctx)
		cancel()
		if err != nil {
			t.Fatal(err)
		}
	}
	tr := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	u := runtime.Unknown{TypeMeta: runtime.TypeMeta{APIVersion: "v1", Kind: "Secret"}, Raw: []byte("payload")}
	raw, err := u.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	for i := range n {
		key := fmt.Sprintf("/registry/secrets/ns/s%04d", i)
		out, err := tr.TransformToStorage(ctx, append([]byte("k8s\x00"), raw...), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(out)); err != nil {
			t.Fatal(err)
		}
	}
}

// TestRotateProviderSwitches runs the provider switches as an operator does, each
// with one rotate command: the new provider goes first, the guard refuses to remove the
// old one while stored Secrets use it, the migration moves them, the guard then allows
// the removal, and the stored Secrets all carry the new provider's prefix and read back
// with the final file alone (for KMS → KMS: with plugin A stopped).
func TestRotateProviderSwitches(t *testing.T) {
	dir, err := os.MkdirTemp("", "rot") // unix socket paths are short
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	plugin := func(name string, seed byte) (endpoint string, stop func()) {
		keys := filepath.Join(dir, name+".keys")
		if err := os.WriteFile(keys, []byte("keys:\n- {name: kek-"+name+", secret: "+secret(seed)+"}\n"), 0o600); err != nil {
			t.Fatal(err)
		}
		endpoint = "unix://" + filepath.Join(dir, name+".sock")
		s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: endpoint, KeysFile: keys})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(s.Stop)
		return endpoint, s.Stop
	}
	endpointA, stopA := plugin("a", 'a')
	endpointB, _ := plugin("b", 'b')
	const head = "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	for _, tc := range []struct {
		name, in string
		flags    []string
		old      string
		// wantPrefix starts every stored Secret in the end.
		wantPrefix string
		// after runs once the old provider is gone, before the final read check.
		after func()
	}{
		{name: "identity to aesgcm", in: head + "      - identity: {}\n",
			flags: []string{"--provider", "aesgcm"}, old: "identity", wantPrefix: "k8s:enc:aesgcm:v1:key-"},
		{name: "identity to kms", in: head + "      - identity: {}\n",
			flags: []string{"--provider", "kms", "--kms-name", "kms-b", "--kms-endpoint", endpointB}, old: "identity", wantPrefix: "k8s:enc:kms:v2:kms-b:"},
		{name: "aescbc to kms", in: head + "      - aescbc:\n          keys: [{name: key1, secret: " + secret('1') + "}]\n",
			flags: []string{"--provider", "kms", "--kms-name", "kms-b", "--kms-endpoint", endpointB}, old: "key1", wantPrefix: "k8s:enc:kms:v2:kms-b:"},
		{name: "aesgcm to kms", in: head + "      - aesgcm:\n          keys: [{name: key1, secret: " + secret('1') + "}]\n      - identity: {}\n",
			flags: []string{"--provider", "kms", "--kms-name", "kms-b", "--kms-endpoint", endpointB}, old: "key1", wantPrefix: "k8s:enc:kms:v2:kms-b:"},
		{name: "kms to kms", in: head + "      - kms: {apiVersion: v2, name: kms-a, endpoint: " + strconv.Quote(endpointA) + ", timeout: 3s}\n",
			flags: []string{"--provider", "kms", "--kms-name", "kms-b", "--kms-endpoint", endpointB}, old: "kms-a", wantPrefix: "k8s:enc:kms:v2:kms-b:",
			after: stopA},
	} {
		t.Run(tc.name, func(t *testing.T) {
			srv := etcdtest.Start(t)
			cli := srv.Client(t)
			etcd := []string{"--etcd-servers", srv.Endpoint}
			path := filepath.Join(t.TempDir(), "enc.yaml")
			if err := os.WriteFile(path, []byte(tc.in), 0o600); err != nil {
				t.Fatal(err)
			}
			seed(t, cli, path, 25)
			if out, err := run(t, append([]string{"rotate", "--encryption-provider-config", path}, tc.flags...)...); err != nil {
				t.Fatalf("rotate: %v\n%s", err, out)
			}
			remove := append([]string{"rotate", "--encryption-provider-config", path, "--remove-old", tc.old}, etcd...)
			added, _ := os.ReadFile(path)
			out, err := run(t, remove...)
			if err == nil || !strings.Contains(err.Error(), "secrets: 25 objects are stored under") {
				t.Fatalf("early --remove-old %s: err = %v, want the guard's refusal naming 25 secrets\n%s", tc.old, err, out)
			}
			if now, _ := os.ReadFile(path); !bytes.Equal(now, added) {
				t.Fatal("the refused removal changed the file")
			}
			if out, err := run(t, append([]string{"migrate", "--encryption-provider-config", path, "--progress", "none"}, etcd...)...); err != nil {
				t.Fatalf("migrate: %v\n%s", err, out)
			}
			if out, err := run(t, remove...); err != nil {
				t.Fatalf("--remove-old %s after the migration: %v\n%s", tc.old, err, out)
			}
			final, _ := os.ReadFile(path)
			if tc.old != "identity" && strings.Contains(string(final), tc.old) {
				t.Fatalf("%s still in the file:\n%s", tc.old, final)
			}
			if tc.after != nil {
				tc.after()
			}
			resp, err := cli.Get(t.Context(), "/registry/secrets/", clientv3.WithPrefix())
			if err != nil {
				t.Fatal(err)
			}
			for _, kv := range resp.Kvs {
				if !strings.HasPrefix(string(kv.Value), tc.wantPrefix) {
					t.Fatalf("%s stored as %.30q, want %s…", kv.Key, kv.Value, tc.wantPrefix)
				}
			}
			if len(resp.Kvs) != 25 {
				t.Fatalf("%d Secrets stored, want 25", len(resp.Kvs))
			}
			out, err = run(t, append([]string{"inventory", "--encryption-provider-config", path, "--decrypt-check"}, etcd...)...)
			if err != nil || !strings.Contains(out, "secrets: 25 objects") || !strings.Contains(out, "0 stale") {
				t.Fatalf("inventory --decrypt-check with the final file: %v\n%s", err, out)
			}
		})
	}
}

// --resources picks rules; it never narrows the guard's scan to part of one: removing
// key1 from the rule for secrets and configmaps, picked with --resources secrets,
// still counts the ConfigMaps under key1 and is refused.
func TestRotateRemoveOldScansEveryResourceOfTheRule(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	dir := t.TempDir()
	rule := func(name string, keys ...string) string {
		var b strings.Builder
		b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets, configmaps]\n    providers:\n      - aesgcm:\n          keys:\n")
		for _, k := range keys {
			fmt.Fprintf(&b, "            - {name: %s, secret: %s}\n", k, secret(k[len(k)-1]))
		}
		path := filepath.Join(dir, name)
		if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	seedResource(t, cli, rule("old.yaml", "key1"), "configmaps", "ns", 3)
	path := rule("enc.yaml", "key2", "key1")
	seed(t, cli, path, 5) // Secrets under key2: nothing of secrets needs key1
	out, err := run(t, "rotate", "--encryption-provider-config", path, "--remove-old", "key1", "--resources", "secrets", "--etcd-servers", srv.Endpoint)
	if err == nil || !strings.Contains(err.Error(), "configmaps") || !strings.Contains(err.Error(), "key1") {
		t.Fatalf("rotate --remove-old key1 --resources secrets: %v, want a refusal naming the ConfigMaps under key1\n%s", err, out)
	}
	if data, _ := os.ReadFile(path); !strings.Contains(string(data), "key1") {
		t.Fatal("key1 was removed although ConfigMaps are stored under it")
	}
}
