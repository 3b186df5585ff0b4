package config_test

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/config"
)

func TestHashMatchesUpstreamVector(t *testing.T) {
	// Upstream's content hash (k8s.io/apiserver/pkg/server/options/encryptionconfig/config.go)
	// is sha256 of the raw file bytes, hex, after "sha256:"; this is the empty input's.
	const want = "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
	if got := config.Hash(nil); got != want {
		t.Fatalf("Hash(empty) = %s, want %s", got, want)
	}
}

func TestLoadDefaultsKMS(t *testing.T) {
	cfg, err := config.Parse([]byte(doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: p\n          endpoint: unix:///tmp/p.sock\n")), "mem", config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	kms := cfg.Encryption.Resources[0].Providers[0].KMS
	if kms.Timeout == nil || kms.Timeout.Duration.String() != "3s" {
		t.Fatalf("timeout not defaulted to 3s: %v", kms.Timeout)
	}
	if kms.CacheSize != nil {
		t.Fatalf("v2 must not get a cachesize default, got %d", *kms.CacheSize)
	}
}

func TestLoadMissingFileNamesIt(t *testing.T) {
	path := filepath.Join(t.TempDir(), "absent.yaml")
	_, err := config.Load(path, config.Options{})
	if err == nil || !strings.Contains(err.Error(), path) {
		t.Fatalf("want an error naming %s, got %v", path, err)
	}
}

// TestErrorsNeverEchoSecrets feeds malformed files that carry a recognisable secret and
// checks no error message contains it (CVE-2020-8564 is the cautionary tale).
func TestErrorsNeverEchoSecrets(t *testing.T) {
	const secret = "c3VwZXJzZWNyZXRrZXltYXRlcmlhbCE=" // 23 bytes: the wrong length for every provider
	cases := map[string]string{
		"wrong length":       doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + secret + "}]\n"),
		"not base64":         doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: '" + secret + "!!'}]\n"),
		"secret as array":    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: ['" + secret + "']}]\n"),
		"broken yaml":        doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + secret + "}\n   : : [\n"),
		"bad indentation":    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n          - name: k\n             secret: " + secret + "\n"),
		"missing kind":       "apiVersion: apiserver.config.k8s.io/v1\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + secret + "}]\n",
		"missing apiVersion": "kind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + secret + "}]\n",
		"tab":                doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n\t\tkeys: [{name: k, secret: " + secret + "}]\n"),
	}
	dir := t.TempDir()
	for name, data := range cases {
		path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-"))
		if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
			t.Fatal(err)
		}
		_, err := config.Load(path, config.Options{})
		if err == nil {
			t.Errorf("%s: want an error", name)
			continue
		}
		if strings.Contains(err.Error(), secret[:16]) {
			t.Errorf("%s: error echoes the secret: %v", name, err)
		}
	}
}
