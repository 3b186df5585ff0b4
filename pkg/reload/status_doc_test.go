package reload_test

import (
	"encoding/json"
	"flag"
	"os"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var updateDoc = flag.Bool("update-status-doc", false, "rewrite the example in docs/status.md")

const statusDoc = "../../docs/status.md"

// exampleStatus is the document docs/status.md shows: an apiserver shim with a KMS v2
// provider for Secrets, aesgcm for ConfigMaps, one refused reload, a finished migration
// and an inventory. Every time is fixed, so the example stays byte for byte true.
func exampleStatus() reload.Status {
	cet := time.FixedZone("CET", 3600) // the document shows UTC whatever the clock's zone
	start := time.Date(2026, 11, 23, 10, 0, 0, 0, cet)
	kms := transformers.KMSStatus{
		Name: "vault", Endpoint: "unix:///var/run/kms/vault.sock", Healthy: true,
		KeyIDHash:     "sha256:9f2c6d7e0b1a4c3d5e6f708192a3b4c5d6e7f8091a2b3c4d5e6f708192a3b4c5",
		DEKSourceType: "HKDF_SHA256_XNONCE_AES_GCM_SEED",
		WriteExpiry:   start.Add(2*time.Hour + 3*time.Minute),
		LastStatus:    start.Add(2*time.Hour + 2*time.Minute),
	}
	inv := &migrate.Inventory{
		TakenAt: start.Add(65 * time.Minute), Duration: 1520 * time.Millisecond,
		ConfigHash: "sha256:4b1d0e3c2a5f6e7d8c9b0a1f2e3d4c5b6a7f8e9d0c1b2a3f4e5d6c7b8a9f0e1d", DecryptChecked: false,
		Resources: []migrate.ResourceInventory{
			{Resource: "secrets", KeyPrefix: "/registry/secrets/", Revision: 48213,
				WritePrefix: "k8s:enc:kms:v2:vault:", WriteKeyIDHash: kms.KeyIDHash, Objects: 1204, Stale: 4, Plaintext: 0, Unreadable: 0,
				Buckets: []migrate.Count{
					{Bucket: migrate.Bucket{Provider: "kms", Key: "vault", KeyIDHash: kms.KeyIDHash, DEKSourceType: kms.DEKSourceType, Prefix: "k8s:enc:kms:v2:vault:", KnownKey: true}, Objects: 1200, Bytes: 1_843_200},
					{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "key1", Prefix: "k8s:enc:aesgcm:v1:key1:", KnownKey: true, Stale: true}, Objects: 4, Bytes: 5_120},
				}},
			{Resource: "configmaps", KeyPrefix: "/registry/configmaps/", Revision: 48213,
				WritePrefix: "k8s:enc:aesgcm:v1:key2:", Objects: 310,
				Buckets: []migrate.Count{
					{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "key2", Prefix: "k8s:enc:aesgcm:v1:key2:", KnownKey: true}, Objects: 310, Bytes: 402_117},
				}},
		},
	}
	return reload.Status{
		ConfigPath:           "/etc/kubernetes/encryption-config.yaml",
		AutomaticReload:      true,
		ActiveConfigHash:     inv.ConfigHash,
		LoadedAt:             start.Add(60 * time.Minute),
		ReloadsSucceeded:     2,
		ReloadsFailed:        1,
		LastAttemptAt:        start.Add(60 * time.Minute),
		LastError:            `new configuration refused: encryption provider configuration file "/etc/kubernetes/encryption-config.yaml" is empty`,
		LastErrorAt:          start.Add(30 * time.Minute),
		LastErrorConfigHash:  "sha256:0c7e5a9b1d3f2e4a6c8b0d2f4e6a8c0b2d4f6e8a0c2b4d6f8e0a2c4b6d8f0e2a",
		ReplacedPendingClose: 1,
		Resources: []transformers.RuleInfo{
			{Resource: "secrets", WriteProvider: "kms", WriteKey: "vault", WritePrefix: "k8s:enc:kms:v2:vault:",
				ReadPrefixes: []string{"k8s:enc:kms:v2:vault:", "k8s:enc:aesgcm:v1:key1:"}, KMS: &kms,
				ReadKeys: []transformers.KeyInfo{{Provider: "kms", Key: "vault", KeyIDHash: kms.KeyIDHash}, {Provider: "aesgcm", Key: "key1"}}},
			{Resource: "configmaps", WriteProvider: "aesgcm", WriteKey: "key2", WritePrefix: "k8s:enc:aesgcm:v1:key2:",
				ReadPrefixes: []string{"k8s:enc:aesgcm:v1:key2:", ""},
				ReadKeys:     []transformers.KeyInfo{{Provider: "aesgcm", Key: "key2"}, {Provider: "identity"}}},
		},
		KMSProviders: []transformers.KMSStatus{kms},
		KeyWrites: []transformers.KeyWrites{
			{KeyInfo: transformers.KeyInfo{Provider: "aesgcm", Key: "key2", Check: "5c1f0e9a7b3d2c48"}, Writes: 310},
			{KeyInfo: transformers.KeyInfo{Provider: "kms", Key: "vault", KeyIDHash: kms.KeyIDHash}, Writes: 1_832},
		},
		Extras: map[string]any{"storage": migrate.ControllerStatus{
			AutoMigrate: true,
			LastMigration: &migrate.MigrationRecord{
				Resources: []string{"secrets"}, Finished: start.Add(62 * time.Minute), Duration: 95*time.Second + 250*time.Millisecond,
				Counters: migrate.Counters{Scanned: 1204, Rewritten: 1196, Current: 4, Conflicts: 2, Gone: 2, Unreadable: 0},
			},
			Inventory: inv,
		}},
	}
}

var exampleBlock = regexp.MustCompile("(?s)<!-- example: begin -->\n```json\n(.*?)```\n<!-- example: end -->")

// docs/status.md shows what the shim serves: its example is this test's output, and
// every member of it is described in the document. Run with -update-status-doc after
// changing the document's shape.
func TestStatusDocumentMatchesDocs(t *testing.T) {
	got, err := json.MarshalIndent(exampleStatus(), "", "  ")
	if err != nil {
		t.Fatal(err)
	}
	got = append(got, '\n')
	doc, err := os.ReadFile(statusDoc)
	if err != nil {
		t.Fatal(err)
	}
	m := exampleBlock.FindSubmatchIndex(doc)
	if m == nil {
		t.Fatalf("%s has no <!-- example: begin --> json block", statusDoc)
	}
	if *updateDoc {
		out := append(append(append([]byte{}, doc[:m[2]]...), got...), doc[m[3]:]...)
		if err := os.WriteFile(statusDoc, out, 0o644); err != nil {
			t.Fatal(err)
		}
		doc = out
	} else if string(doc[m[2]:m[3]]) != string(got) {
		t.Fatalf("the example in %s is not what the status handler writes; run go test ./pkg/reload -run TestStatusDocumentMatchesDocs -update-status-doc\nwant:\n%s", statusDoc, got)
	}

	var v any
	if err := json.Unmarshal(got, &v); err != nil {
		t.Fatal(err)
	}
	var missing []string
	for _, k := range members(v, nil) {
		if !strings.Contains(string(doc), "`"+k+"`") {
			missing = append(missing, k)
		}
	}
	if len(missing) > 0 {
		t.Errorf("%s does not describe these members (write each as `name` in a table): %v", statusDoc, missing)
	}
	if strings.Contains(string(got), "null") {
		t.Errorf("the status document has a null:\n%s", got)
	}
}

// members lists every object member name in v.
func members(v any, acc []string) []string {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if !slices.Contains(acc, k) {
				acc = append(acc, k)
			}
			acc = members(e, acc)
		}
	case []any:
		for _, e := range x {
			acc = members(e, acc)
		}
	}
	return acc
}
