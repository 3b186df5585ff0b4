package main

import (
	"bytes"
	"flag"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
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
			if _, _, err := rotateDrop(res.cfg, res.newKey); err == nil {
				t.Error("removing the write key itself was accepted")
			}
			dropped, rules, err := rotateDrop(res.cfg, tc.oldKey)
			if err != nil {
				t.Fatal(err)
			}
			if len(rules) != len(res.rules) {
				t.Errorf("dropped from rules %v, rotated %v", rules, res.rules)
			}
			checkGolden(t, dropped, tc.name+".drop.yaml")
			// A re-run of the second step finds nothing left to remove.
			if _, _, err := rotateDrop(dropped, tc.oldKey); err == nil || !strings.Contains(err.Error(), "nothing to remove") {
				t.Errorf("second removal: err = %v, want nothing to remove", err)
			}
		})
	}
}

func TestRotateRefuses(t *testing.T) {
	twoRules := readExternal(t, "aesgcm.in.yaml")
	twoRules.Resources[1].Providers = twoRules.Resources[0].Providers
	for _, tc := range []struct {
		name string
		cfg  *apiserverv1.EncryptionConfiguration
		r    rotation
		want string
	}{
		{"identity without --provider", readExternal(t, "identity.in.yaml"), rotation{}, "pass --provider aesgcm"},
		{"kms over two rules", twoRules, rotation{provider: providerKMS, kmsName: "b", kmsEndpoint: "unix:///b.sock"}, "choose one with --resources"},
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
