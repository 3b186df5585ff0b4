package config_test

import (
	"context"
	"crypto/fips140"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/server/options/encryptionconfig"

	"github.com/rekey-io/rekey/pkg/config"
)

// Keys used in the table (base64 of 16, 24, 32 and 10 zero-free bytes).
const (
	key16 = "MTIzNDU2Nzg5MDEyMzQ1Ng=="                     // 16 bytes
	key24 = "MTIzNDU2Nzg5MDEyMzQ1Njc4OTAxMjM0"             // 24 bytes
	key32 = "MTIzNDU2Nzg5MDEyMzQ1Njc4OTAxMjM0NTY3ODkwMTI=" // 32 bytes
	key10 = "MTIzNDU2Nzg5MA=="                             // 10 bytes
)

func doc(resources string) string {
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" + resources
}

// kmsV2 renders one KMS v2 provider entry. The endpoint never exists: upstream then
// waits for the timeout once and still accepts the config, which is what we compare.
func kmsV2(name string, extra string) string {
	return "      - kms:\n          apiVersion: v2\n          name: " + name + "\n          endpoint: unix:///tmp/rekey-nonexistent-" + name + ".sock\n          timeout: 20ms\n" + extra
}

type tableCase struct {
	name string
	data string
	// wantErr is a fragment both upstream's and our error must contain; "" means valid.
	wantErr string
	// reload selects upstream's reload validation (KMS v1 names must be unique too).
	reload bool
	// rekeyDiffers marks a case where rekey's rule is not upstream's (KMS v1, which
	// upstream refuses with its feature gate off and rekey reads): wantErr is then only
	// upstream's, and rekeyErr is the fragment our error must contain ("" means valid).
	rekeyDiffers bool
	rekeyErr     string
}

// validationTable covers every rule of upstream's decoding and validation
// (k8s.io/apiserver/pkg/apis/apiserver/validation/validation_encryption.go) and the
// checks upstream makes only while building transformers
// (k8s.io/apiserver/pkg/server/options/encryptionconfig/config.go), which rekey makes at
// validation time.
var validationTable = []tableCase{
	// --- decoding ---
	{name: "valid aesgcm yaml", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: key1, secret: " + key32 + "}]\n")},
	{name: "valid json", data: `{"apiVersion":"apiserver.config.k8s.io/v1","kind":"EncryptionConfiguration","resources":[{"resources":["secrets"],"providers":[{"aescbc":{"keys":[{"name":"k","secret":"` + key32 + `"}]}},{"identity":{}}]}]}`},
	{name: "legacy alias kind EncryptionConfig apiVersion v1", data: "apiVersion: v1\nkind: EncryptionConfig\nresources:\n  - resources: [secrets]\n    providers:\n      - identity: {}\n"},
	{name: "empty file", data: "", wantErr: "is empty"},
	{name: "unknown field", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: key1, secret: " + key32 + "}]\n          pandas: true\n"), wantErr: `unknown field "resources[0].providers[0].aesgcm.pandas"`},
	{name: "duplicate field", data: doc("  - resources: [secrets]\n    resources: [configmaps]\n    providers:\n      - identity: {}\n"), wantErr: "strict decoding error"},
	{name: "wrong kind", data: "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfigurations\nresources: []\n", wantErr: `no kind "EncryptionConfigurations" is registered for version "apiserver.config.k8s.io/v1"`},
	{name: "missing kind", data: "apiVersion: apiserver.config.k8s.io/v1\nkinds: EncryptionConfiguration\nresources: []\n", wantErr: "error decoding encryption provider configuration file"},
	{name: "not yaml", data: "::: [", wantErr: "error decoding encryption provider configuration file"},

	// --- top level ---
	{name: "no resources", data: doc("  []\n"), wantErr: "at least one resources is required"},
	{name: "empty resource list", data: doc("  - resources: []\n    providers:\n      - identity: {}\n"), wantErr: "at least one resources[0].resources is required"},
	{name: "empty provider list", data: doc("  - resources: [secrets]\n    providers: []\n"), wantErr: "at least one resources[0].providers is required"},

	// --- resource names ---
	{name: "duplicate resource in one list", data: doc("  - resources: [secrets, secrets]\n    providers:\n      - identity: {}\n"), wantErr: "the same resource cannot be specified multiple times"},
	{name: "overlap with *.", data: doc("  - resources: [secrets, '*.']\n    providers:\n      - identity: {}\n"), wantErr: "using overlapping resources such as 'secrets' and '*.' in the same resource list is not allowed as they will be masked"},
	{name: "overlap with *.*", data: doc("  - resources: ['*.*', configmaps]\n    providers:\n      - identity: {}\n"), wantErr: "will be masked"},
	{name: "overlap with group wildcard", data: doc("  - resources: [deployments.apps, '*.apps']\n    providers:\n      - identity: {}\n"), wantErr: "will be masked"},
	{name: "no overlap across groups", data: doc("  - resources: [deployments.apps, '*.batch', secrets]\n    providers:\n      - identity: {}\n")},
	{name: "capital letters", data: doc("  - resources: [Secrets]\n    providers:\n      - identity: {}\n"), wantErr: "resource name should not contain capital letters"},
	{name: "bare star", data: doc("  - resources: ['*']\n    providers:\n      - identity: {}\n"), wantErr: "use '*.' to encrypt all the resources from core API group or *.* to encrypt all resources"},
	{name: "apiserveripinfo", data: doc("  - resources: [apiserveripinfo]\n    providers:\n      - identity: {}\n"), wantErr: "resources which do not have REST API/s cannot be encrypted"},
	{name: "serviceipallocations", data: doc("  - resources: [serviceipallocations]\n    providers:\n      - identity: {}\n"), wantErr: "resources which do not have REST API/s cannot be encrypted"},
	{name: "servicenodeportallocations", data: doc("  - resources: [servicenodeportallocations]\n    providers:\n      - identity: {}\n"), wantErr: "resources which do not have REST API/s cannot be encrypted"},
	{name: "events.k8s.io group", data: doc("  - resources: ['*.events.k8s.io']\n    providers:\n      - identity: {}\n"), wantErr: "objects are stored using the 'events' API group in etcd"},
	{name: "extensions group", data: doc("  - resources: [deployments.extensions]\n    providers:\n      - identity: {}\n"), wantErr: "'extensions' group has been removed and cannot be used for encryption"},
	{name: "resource across groups", data: doc("  - resources: ['secrets.*']\n    providers:\n      - identity: {}\n"), wantErr: "encrypting the same resource across groups is not supported"},
	{name: "multi-dot group", data: doc("  - resources: [pandas.awesome.bears.example]\n    providers:\n      - identity: {}\n")},

	// --- providers ---
	{name: "empty provider element", data: doc("  - resources: [secrets]\n    providers:\n      - {}\n"), wantErr: "provider does not contain any of the expected providers: KMS, AESGCM, AESCBC, Secretbox, Identity"},
	{name: "two providers in one element", data: doc("  - resources: [secrets]\n    providers:\n      - identity: {}\n        aesgcm:\n          keys: [{name: k, secret: " + key32 + "}]\n"), wantErr: "more than one provider specified in a single element, should split into different list elements"},

	// --- keys ---
	{name: "aesgcm no keys", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: []\n"), wantErr: "is required"},
	{name: "aesgcm null keys", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n"), wantErr: "is required"},
	{name: "key without name", data: doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: '', secret: " + key32 + "}]\n"), wantErr: "name is a mandatory field for a key"},
	{name: "key without secret", data: doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: k}]\n"), wantErr: "secret is a mandatory field for a key"},
	{name: "secret not base64", data: doc("  - resources: [secrets]\n    providers:\n      - secretbox:\n          keys: [{name: k, secret: 'not*base64'}]\n"), wantErr: "secrets must be base64 encoded"},
	{name: "aesgcm 10-byte key", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + key10 + "}]\n"), wantErr: "secret is not of the expected length, got 10, expected one of [16 24 32]"},
	{name: "aescbc 24-byte key", data: doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: k, secret: " + key24 + "}]\n")},
	{name: "aesgcm 16-byte key", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + key16 + "}]\n")},
	{name: "secretbox 16-byte key", data: doc("  - resources: [secrets]\n    providers:\n      - secretbox:\n          keys: [{name: k, secret: " + key16 + "}]\n"), wantErr: "secret is not of the expected length, got 16, expected one of [32]"},
	{name: "key names may repeat and contain colons", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: 'a:b', secret: " + key32 + "}, {name: 'a:b', secret: " + key16 + "}]\n")},

	// --- kms ---
	{name: "kms v2 valid, plugin absent", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("good", ""))},
	{name: "kms without name", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          endpoint: unix:///tmp/x.sock\n"), wantErr: "name is a mandatory field for a provider"},
	{name: "kms v2 name with colon", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("a:b", "")), wantErr: "invalid KMS provider name a:b, must not contain ':'"},
	{name: "kms v2 duplicate names", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("dup", "") + kmsV2("dup", "")), wantErr: "duplicate KMS provider name dup, names must be unique"},
	{name: "kms v2 duplicate names across entries", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("dup2", "") + "  - resources: [configmaps]\n    providers:\n" + kmsV2("dup2", "")), wantErr: "duplicate KMS provider name dup2, names must be unique"},
	{name: "kms zero timeout", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: t0\n          endpoint: unix:///tmp/x.sock\n          timeout: 0s\n"), wantErr: "timeout should be a positive value"},
	{name: "kms negative timeout", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: tneg\n          endpoint: unix:///tmp/x.sock\n          timeout: -1s\n"), wantErr: "timeout should be a positive value"},
	{name: "kms empty endpoint", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: noep\n"), wantErr: "endpoint is a mandatory field for a kms"},
	{name: "kms tcp endpoint", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: tcp\n          endpoint: tcp://127.0.0.1:80\n"), wantErr: `unsupported scheme "tcp" for KMS provider, only unix is supported`},
	{name: "kms unparsable endpoint", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: badurl\n          endpoint: 'unix://%zz'\n"), wantErr: "invalid endpoint for kms provider"},
	{name: "kms v2 with cachesize", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("cs", "          cachesize: 10\n")), wantErr: "cachesize is not supported in v2"},
	{name: "kms v3", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v3\n          name: v3\n          endpoint: unix:///tmp/x.sock\n"), wantErr: "unsupported apiVersion apiVersion for KMS provider, only v1 and v2 are supported"},
	{name: "kms v1 zero cachesize", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          name: v1zero\n          endpoint: unix:///tmp/x.sock\n          cachesize: 0\n"), wantErr: "cachesize should be a positive value, or negative to disable"},
	{name: "kms v1 is deprecated (feature gate off)", data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          name: v1\n          endpoint: unix:///tmp/x.sock\n"), wantErr: "KMSv1 is deprecated and will only receive security updates going forward",
		rekeyDiffers: true, rekeyErr: config.KMSv1ReadOnlyError},
	{name: "kms v1 behind a writer (feature gate off)", data: doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + key32 + "}]\n      - kms:\n          name: v1behind\n          endpoint: unix:///tmp/x.sock\n"), wantErr: "KMSv1 is deprecated and will only receive security updates going forward",
		rekeyDiffers: true},
	{name: "kms v1 duplicate names with reload", reload: true, data: doc("  - resources: [secrets]\n    providers:\n      - kms:\n          name: v1dup\n          endpoint: unix:///tmp/x.sock\n      - kms:\n          name: v1dup\n          endpoint: unix:///tmp/x.sock\n"), wantErr: "duplicate KMS provider name v1dup, names must be unique"},

	// --- wildcard masking (upstream finds these while constructing transformers) ---
	{name: "masked by earlier *.", data: doc("  - resources: ['*.']\n    providers:\n      - identity: {}\n  - resources: [secrets]\n    providers:\n      - identity: {}\n"), wantErr: `resource "secrets" is masked by earlier rule "*."`},
	{name: "masked by earlier *.*", data: doc("  - resources: ['*.*']\n    providers:\n      - identity: {}\n  - resources: [deployments.apps]\n    providers:\n      - identity: {}\n"), wantErr: `resource "deployments.apps" is masked by earlier rule "*.*"`},
	{name: "masked by earlier *.apps", data: doc("  - resources: ['*.apps']\n    providers:\n      - identity: {}\n  - resources: [deployments.apps]\n    providers:\n      - identity: {}\n"), wantErr: `resource "deployments.apps" is masked by earlier rule "*.apps"`},
	{name: "wildcard repeated in later entry", data: doc("  - resources: ['*.*']\n    providers:\n      - identity: {}\n  - resources: ['*.*']\n    providers:\n      - identity: {}\n"), wantErr: `resource "*.*" is masked by earlier rule "*.*"`},
	{name: "specific before wildcard is an opt-out", data: doc("  - resources: [secrets]\n    providers:\n      - identity: {}\n  - resources: ['*.', '*.*']\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + key32 + "}]\n"), wantErr: "will be masked"},
	{name: "specific before wildcards in separate entries", data: doc("  - resources: [secrets]\n    providers:\n      - identity: {}\n  - resources: ['*.']\n    providers:\n      - aesgcm:\n          keys: [{name: k, secret: " + key32 + "}]\n  - resources: ['*.*']\n    providers:\n      - aescbc:\n          keys: [{name: k, secret: " + key32 + "}]\n")},
	{name: "same resource in two entries is appended", data: doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: k, secret: " + key32 + "}]\n  - resources: [secrets]\n    providers:\n      - identity: {}\n")},
}

// TestValidationMatchesUpstream feeds every case to upstream's LoadEncryptionConfig and to
// config.Parse: both must accept, or both must reject with the same words.
func TestValidationMatchesUpstream(t *testing.T) {
	dir := t.TempDir()
	for _, tc := range validationTable {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(tc.name, " ", "_")+".yaml")
			if err := os.WriteFile(path, []byte(tc.data), 0o600); err != nil {
				t.Fatal(err)
			}
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
			defer cancel()
			_, upErr := encryptionconfig.LoadEncryptionConfig(ctx, path, tc.reload, "compat-test")
			cfg, ourErr := config.Load(path, config.Options{Reload: tc.reload})
			if upErr != nil && fips140.Enforced() && strings.Contains(upErr.Error(), "FIPS 140-only mode") {
				// Upstream builds its aesgcm with cipher.NewGCM, which Go refuses under
				// GODEBUG=fips140=only: it cannot load this case there. rekey's side is
				// still checked against the table.
				want := tc.wantErr
				if tc.rekeyDiffers {
					want = tc.rekeyErr
				}
				if (want == "") != (ourErr == nil) || (ourErr != nil && !strings.Contains(ourErr.Error(), want)) {
					t.Fatalf("rekey: err = %v, want %q", ourErr, want)
				}
				t.Skipf("upstream cannot load this case under fips140=only (%v); the comparison runs in the default build", upErr)
			}
			if tc.rekeyDiffers {
				if upErr == nil || !strings.Contains(upErr.Error(), tc.wantErr) {
					t.Fatalf("upstream's error %v does not contain %q (fix the table)", upErr, tc.wantErr)
				}
				switch {
				case tc.rekeyErr == "" && ourErr != nil:
					t.Fatalf("rekey refused a configuration it reads: %v", ourErr)
				case tc.rekeyErr != "" && (ourErr == nil || !strings.Contains(ourErr.Error(), tc.rekeyErr)):
					t.Fatalf("rekey's error %v does not contain %q", ourErr, tc.rekeyErr)
				case ourErr != nil && strings.Contains(ourErr.Error(), "--feature-gates"):
					t.Fatalf("rekey's error %q points to a feature gate", ourErr)
				}
				return
			}

			if tc.wantErr == "" {
				if upErr != nil {
					t.Fatalf("upstream rejected a case the table says is valid: %v", upErr)
				}
				if ourErr != nil {
					t.Fatalf("we rejected a config upstream accepts: %v", ourErr)
				}
				if cfg.Hash != config.Hash([]byte(tc.data)) || !strings.HasPrefix(cfg.Hash, "sha256:") {
					t.Fatalf("hash = %q", cfg.Hash)
				}
				return
			}
			if upErr == nil {
				t.Fatalf("upstream accepted a case the table says is invalid (want %q)", tc.wantErr)
			}
			if !strings.Contains(upErr.Error(), tc.wantErr) {
				t.Fatalf("upstream's error %q does not contain %q (fix the table)", upErr, tc.wantErr)
			}
			if ourErr == nil {
				t.Fatalf("we accepted a config upstream rejects with %q", upErr)
			}
			if !strings.Contains(ourErr.Error(), tc.wantErr) {
				t.Fatalf("our error %q does not contain upstream's words %q", ourErr, tc.wantErr)
			}
			if !strings.Contains(ourErr.Error(), path) {
				t.Fatalf("our error %q does not name the file", ourErr)
			}
		})
	}
}
