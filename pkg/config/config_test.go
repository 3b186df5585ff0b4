package config_test

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/configtest"
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

// TestSecretEchoTable: no error for a malformed file quotes a secret from it, through
// Parse and through Load. Before redaction the two-provider typo rendered the whole
// provider, keys included, and YAML errors quoted tagged values and map keys.
func TestSecretEchoTable(t *testing.T) {
	dir := t.TempDir()
	for i, tc := range configtest.SecretEcho() {
		t.Run(tc.Name, func(t *testing.T) {
			_, err := config.Parse([]byte(tc.Data), "mem.yaml", config.Options{Reload: true})
			if err == nil {
				t.Fatal("Parse accepted a malformed config")
			}
			if leaks := configtest.Leaks(err.Error(), tc.Secrets...); len(leaks) > 0 {
				t.Errorf("Parse error quotes a secret (%q): %v", leaks, err)
			}
			path := filepath.Join(dir, fmt.Sprintf("case%d.yaml", i))
			if err := os.WriteFile(path, []byte(tc.Data), 0o600); err != nil {
				t.Fatal(err)
			}
			_, err = config.Load(path, config.Options{})
			if err == nil {
				t.Fatal("Load accepted a malformed config")
			}
			if leaks := configtest.Leaks(err.Error(), tc.Secrets...); len(leaks) > 0 {
				t.Errorf("Load error quotes a secret (%q): %v", leaks, err)
			}
			t.Logf("%v", err)
		})
	}
}

// TestRedactedErrorsKeepPathTypeAndDetail: redaction keeps what makes an error useful.
func TestRedactedErrorsKeepPathTypeAndDetail(t *testing.T) {
	cases := []struct{ data, want string }{
		{
			configtest.SecretEcho()[0].Data,
			"resources[0].providers[0]: Invalid value: <redacted>: more than one provider specified in a single element, should split into different list elements",
		},
		{
			doc("  - resources: [Secrets]\n    providers:\n      - identity: {}\n"),
			`resources[0].resources[0]: Invalid value: "Secrets": resource name should not contain capital letters`,
		},
		{
			doc("  - resources: [secrets]\n    providers:\n      - kms: {apiVersion: v2, name: 'a:b', endpoint: 'unix:///x.sock'}\n"),
			"resources[0].providers[0].kms.name: Invalid value: <redacted>: invalid KMS provider name a:b, must not contain ':'",
		},
		{
			configtest.SecretEcho()[4].Data, // !!int
			`error decoding encryption provider configuration file "mem.yaml": a value tagged !!int is not a valid int`,
		},
		{
			configtest.SecretEcho()[13].Data, // secret as a field name
			`strict decoding error: unknown field "resources[0].providers[0].aesgcm.keys[0].<redacted>"`,
		},
		{
			doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: 12}]\n"),
			"field resources.providers.aesgcm.keys.secret must be of type string, got a JSON number",
		},
		{
			doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: x}\n   : : [\n"),
			"YAML syntax error at line 7: did not find expected ',' or ']'",
		},
	}
	for _, tc := range cases {
		_, err := config.Parse([]byte(tc.data), "mem.yaml", config.Options{})
		if err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("error %v\ndoes not contain %q", err, tc.want)
		}
	}
}
