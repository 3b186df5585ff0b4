package main

import (
	"bytes"
	"context"
	"flag"
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
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

var updateGolden = flag.Bool("update", false, "rewrite the golden files in testdata/rotate")

var rotateNow = time.Date(2026, 11, 23, 20, 30, 0, 0, time.UTC)

// fixedRandom is a deterministic key source so the golden files hold a known secret.
func fixedRandom() *bytes.Reader { return bytes.NewReader(bytes.Repeat([]byte{0xA5}, 64)) }

func readExternal(t *testing.T, name string) *apiserverv1.EncryptionConfiguration {
	t.Helper()
	data, err := os.ReadFile(filepath.Join("testdata", "rotate", name))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := config.Parse(data, name, config.Options{Reload: true}); err != nil {
		t.Fatalf("input %s is not valid: %v", name, err)
	}
	cfg, err := decodeExternal(data)
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// checkGolden compares cfg's YAML with testdata/rotate/name and validates it as the
// apiserver would.
func checkGolden(t *testing.T, cfg *apiserverv1.EncryptionConfiguration, name string) {
	t.Helper()
	got, err := encodeExternal(cfg)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := config.Parse(got, name, config.Options{Reload: true}); err != nil {
		t.Fatalf("%s: result is not a valid configuration: %v\n%s", name, err, got)
	}
	path := filepath.Join("testdata", "rotate", name)
	if *updateGolden {
		if err := os.WriteFile(path, got, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run TestRotateGolden -update to create it)", err)
	}
	if !bytes.Equal(got, want) {
		t.Errorf("%s differs:\n--- got\n%s--- want\n%s", name, got, want)
	}
}

// TestRotateGolden covers every switch rotate makes in one command: the added write key
// (first step) and the removal of the key it replaced (second step).
func TestRotateGolden(t *testing.T) {
	for _, tc := range []struct {
		name, in string
		r        rotation
		newKey   string
		oldKey   string
		warn     bool
	}{
		{name: "aesgcm-same", in: "aesgcm.in.yaml", newKey: "key-20261123T203000Z", oldKey: "key1"},
		{name: "aesgcm-to-secretbox", in: "aesgcm.in.yaml", r: rotation{provider: providerSecretbox}, newKey: "key-20261123T203000Z", oldKey: "key1"},
		{name: "aescbc-same", in: "aescbc-two-keys.in.yaml", newKey: "key-20261123T203000Z", warn: true, oldKey: "key2"},
		{name: "aescbc-to-aesgcm", in: "aescbc-two-keys.in.yaml", r: rotation{provider: providerAESGCM}, newKey: "key-20261123T203000Z", oldKey: "key2"},
		{name: "identity-to-aesgcm", in: "identity.in.yaml", r: rotation{provider: providerAESGCM}, newKey: "key-20261123T203000Z", oldKey: "identity"},
		{name: "aesgcm-to-kms", in: "aesgcm.in.yaml", r: rotation{provider: providerKMS, kmsName: "vault-b", kmsEndpoint: "unix:///var/run/kms-b.sock"}, newKey: "vault-b", oldKey: "key1"},
		{name: "aescbc-to-kms", in: "aescbc-two-keys.in.yaml", r: rotation{provider: providerKMS, kmsName: "vault-b", kmsEndpoint: "unix:///var/run/kms-b.sock"}, newKey: "vault-b", oldKey: "key2"},
		{name: "identity-to-kms", in: "identity.in.yaml", r: rotation{provider: providerKMS, kmsName: "vault-b", kmsEndpoint: "unix:///var/run/kms-b.sock"}, newKey: "vault-b", oldKey: "identity"},
		{name: "kms-to-kms", in: "kms.in.yaml", r: rotation{provider: providerKMS, kmsName: "vault-b", kmsEndpoint: "unix:///var/run/kms-b.sock", kmsTimeout: 5 * time.Second}, newKey: "vault-b", oldKey: "vault-a"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			in := readExternal(t, tc.in)
			before, _ := encodeExternal(in)
			tc.r.now, tc.r.random = rotateNow, fixedRandom()
			res, err := rotateAdd(in, tc.r)
			if err != nil {
				t.Fatal(err)
			}
			if after, _ := encodeExternal(in); !bytes.Equal(before, after) {
				t.Fatal("rotateAdd changed its input")
			}
			if res.newKey != tc.newKey {
				t.Errorf("new key = %q, want %q", res.newKey, tc.newKey)
			}
			if got := len(res.warnings) > 0; got != tc.warn {
				t.Errorf("warnings = %q, want a warning: %v", res.warnings, tc.warn)
			}
			checkGolden(t, res.cfg, tc.name+".add.yaml")

			if len(res.oldKeys) != 1 || res.oldKeys[0] != tc.oldKey {
				t.Errorf("old keys = %q, want [%s]", res.oldKeys, tc.oldKey)
			}
			// The new write key is never removed as "old".
			if _, _, err := rotateDrop(res.cfg, res.newKey, nil); err == nil {
				t.Error("removing the write key itself was accepted")
			}
			dropped, rules, err := rotateDrop(res.cfg, tc.oldKey, nil)
			if err != nil {
				t.Fatal(err)
			}
			if len(rules) != len(res.rules) {
				t.Errorf("dropped from rules %v, rotated %v", rules, res.rules)
			}
			checkGolden(t, dropped, tc.name+".drop.yaml")
			// A re-run of the second step finds nothing left to remove.
			if _, _, err := rotateDrop(dropped, tc.oldKey, nil); err == nil || !strings.Contains(err.Error(), "nothing to remove") {
				t.Errorf("second removal: err = %v, want nothing to remove", err)
			}
		})
	}
}

func TestRotateRefuses(t *testing.T) {
	twoRules := readExternal(t, "aesgcm.in.yaml")
	twoRules.Resources[1].Providers = twoRules.Resources[0].Providers
	twoIdentity := readExternal(t, "aesgcm.in.yaml")
	twoIdentity.Resources[0].Providers = twoIdentity.Resources[1].Providers
	for _, tc := range []struct {
		name string
		cfg  *apiserverv1.EncryptionConfiguration
		r    rotation
		want string
	}{
		{"identity without --provider", readExternal(t, "identity.in.yaml"), rotation{}, "pass --provider aesgcm"},
		{"kms over two rules", twoRules, rotation{provider: providerKMS, kmsName: "b", kmsEndpoint: "unix:///b.sock"}, "choose one with --resources"},
		{"kms over two identity rules", twoIdentity, rotation{provider: providerKMS, kmsName: "b", kmsEndpoint: "unix:///b.sock"}, "choose one with --resources"},
		{"kms name taken", readExternal(t, "kms.in.yaml"), rotation{provider: providerKMS, kmsName: "vault-a", kmsEndpoint: "unix:///b.sock"}, "already a KMS provider"},
		{"kms without name", readExternal(t, "kms.in.yaml"), rotation{provider: providerKMS, kmsEndpoint: "unix:///b.sock"}, "needs --kms-name"},
		{"kms tcp endpoint", readExternal(t, "kms.in.yaml"), rotation{provider: providerKMS, kmsName: "b", kmsEndpoint: "tcp://10.0.0.1:80"}, "unix socket"},
		{"kms name with colon", readExternal(t, "kms.in.yaml"), rotation{provider: providerKMS, kmsName: "a:b", kmsEndpoint: "unix:///b.sock"}, "contains ':'"},
		{"unknown type", readExternal(t, "aesgcm.in.yaml"), rotation{provider: "rot13"}, "not one rotate writes with"},
		{"resources naming no rule", readExternal(t, "aesgcm.in.yaml"), rotation{resources: []string{"pods"}}, "no rule naming pods"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tc.r.now, tc.r.random = rotateNow, fixedRandom()
			_, err := rotateAdd(tc.cfg, tc.r)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want %q", err, tc.want)
			}
		})
	}
}

func TestRotateResourcesLimit(t *testing.T) {
	cfg := readExternal(t, "aesgcm.in.yaml")
	cfg.Resources[1].Providers = cfg.Resources[0].Providers
	res, err := rotateAdd(cfg, rotation{resources: []string{"events"}, now: rotateNow, random: fixedRandom()})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.rules) != 1 || res.rules[0] != 1 {
		t.Fatalf("rotated rules %v, want only [1] (events)", res.rules)
	}
}

func TestNewKeyName(t *testing.T) {
	// An existing name that is a start of the generated one: no suffix helps.
	if n, err := newKeyName(rotateNow, []string{"key-2026"}); err == nil {
		t.Errorf("newKeyName with key-2026 present = %q, want an error", n)
	}
	base := "key-20261123T203000Z"
	for _, tc := range []struct {
		existing []string
		want     string
	}{
		{nil, base},
		{[]string{"key1"}, base},
		{[]string{base}, "key-20261123T203001Z"},
		// A name that the next candidate is a prefix of is skipped too.
		{[]string{base, "key-20261123T203001Zx"}, "key-20261123T203002Z"},
	} {
		got, err := newKeyName(rotateNow, tc.existing)
		if err != nil {
			t.Fatal(err)
		}
		if got != tc.want {
			t.Errorf("newKeyName(%q) = %q, want %q", tc.existing, got, tc.want)
		}
		if strings.Contains(got, ":") {
			t.Errorf("name %q contains ':'", got)
		}
	}
}

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

// TestRotateProviderSwitches runs item 2's switches as an operator does, each
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

// The second step stays inside the rules --resources names: removing identity after a
// rotation of secrets must not touch a configmaps rule that still reads plaintext.
func TestRotateDropKeepsToTheNamedResources(t *testing.T) {
	key := func(name string) apiserverv1.Key { return apiserverv1.Key{Name: name, Secret: "c2VjcmV0"} }
	aesgcm := func(names ...string) apiserverv1.ProviderConfiguration {
		var ks []apiserverv1.Key
		for _, n := range names {
			ks = append(ks, key(n))
		}
		return apiserverv1.ProviderConfiguration{AESGCM: &apiserverv1.AESConfiguration{Keys: ks}}
	}
	identity := apiserverv1.ProviderConfiguration{Identity: &apiserverv1.IdentityConfiguration{}}
	cfg := &apiserverv1.EncryptionConfiguration{Resources: []apiserverv1.ResourceConfiguration{
		{Resources: []string{"secrets"}, Providers: []apiserverv1.ProviderConfiguration{aesgcm("k2", "k1"), identity}},
		{Resources: []string{"configmaps"}, Providers: []apiserverv1.ProviderConfiguration{aesgcm("c1"), identity}},
	}}
	dropped, rules, err := rotateDrop(cfg, "identity", []string{"secrets"})
	if err != nil {
		t.Fatal(err)
	}
	if len(rules) != 1 || rules[0] != 0 || len(dropped.Resources[0].Providers) != 1 || len(dropped.Resources[1].Providers) != 2 {
		t.Fatalf("rotateDrop(identity, --resources secrets) changed rules %v: %+v", rules, dropped.Resources)
	}
	if _, _, err := rotateDrop(cfg, "c1", []string{"secrets"}); err == nil || !strings.Contains(err.Error(), "no rule naming secrets") {
		t.Fatalf("rotateDrop(c1, --resources secrets) = %v, want nothing to remove in secrets", err)
	}
	if dropped, rules, err := rotateDrop(cfg, "identity", nil); err != nil || len(rules) != 2 || len(dropped.Resources[1].Providers) != 1 {
		t.Fatalf("rotateDrop(identity) without --resources: rules %v, err %v; want both rules", rules, err)
	}
}
