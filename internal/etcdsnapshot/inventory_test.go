package etcdsnapshot

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var (
	secret1 = []byte("0123456789abcdef0123456789abcdef")
	secret2 = []byte("fedcba9876543210fedcba9876543210")
)

func aesgcmConfig(t *testing.T, keys map[string][]byte, order ...string) *config.Config {
	t.Helper()
	doc := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n"
	for _, k := range order {
		doc += "      - name: " + k + "\n        secret: " + base64.StdEncoding.EncodeToString(keys[k]) + "\n"
	}
	doc += "  - identity: {}\n"
	cfg, err := config.Parse([]byte(doc), "test.yaml", config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// A snapshot taken before a rotation needs the old key; a configuration without it
// (or with another secret under its name) cannot read it, one with it can.
func TestSnapshotBeforeRotationNeedsTheOldKey(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	put := func(k, v string) {
		t.Helper()
		if _, err := cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	// Classification reads the stored prefix only, so the ciphertext need not be real.
	put("/registry/secrets/default/a", "k8s:enc:aesgcm:v1:key1:ciphertext-a")
	put("/registry/secrets/default/b", "k8s:enc:aesgcm:v1:key1:ciphertext-b")
	put("/registry/secrets/default/gone", "k8s:enc:aesgcm:v1:key1:deleted-later")
	put("/registry/configmaps/default/c", "plaintext")
	put("/registry/secrets/default/a", "k8s:enc:aesgcm:v1:key1:ciphertext-a2") // latest revision counts
	if _, err := cli.Delete(ctx, "/registry/secrets/default/gone"); err != nil {
		t.Fatal(err)
	}
	var l keyledger.Ledger
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(aesgcmConfig(t, map[string][]byte{"key1": secret1}, "key1"))}, time.Now(), 1, 0)
	data, _ := json.Marshal(l)
	put(keyledger.Key("/rekey"), string(data))

	rc, err := cli.Snapshot(ctx)
	if err != nil {
		t.Fatal(err)
	}
	path := filepath.Join(t.TempDir(), "before-rotation.db")
	f, err := os.Create(path)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(f, rc); err != nil {
		t.Fatal(err)
	}
	_ = rc.Close()
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	// The rotation after the snapshot changes nothing in it.
	put("/registry/secrets/default/a", "k8s:enc:aesgcm:v1:key2:ciphertext")

	rep, err := Inventory(context.Background(), path, Options{Layout: storagelayout.Kube("/registry"), CoordinationPrefix: "/rekey", Read: readOpts()})
	if err != nil {
		t.Fatal(err)
	}
	check1 := transformers.CheckValue(transformers.AESGCMPrefix, secret1)
	if rep.Ledger == nil || len(rep.Resources) != 2 {
		t.Fatalf("report = %+v, want configmaps and secrets and the ledger", rep)
	}
	cm, sec := rep.Resources[0], rep.Resources[1]
	if cm.Resource != "configmaps" || len(cm.Buckets) != 1 || cm.Buckets[0].Provider != "identity" || cm.Buckets[0].Objects != 1 {
		t.Fatalf("configmaps = %+v, want 1 plaintext", cm)
	}
	if sec.Resource != "secrets" || sec.Objects != 2 || len(sec.Buckets) != 1 {
		t.Fatalf("secrets = %+v, want 2 objects (the deleted one skipped) in one bucket", sec)
	}
	if b := sec.Buckets[0]; b.Provider != "aesgcm" || b.Key != "key1" || b.Prefix != "k8s:enc:aesgcm:v1:key1:" || b.Objects != 2 || len(b.Checks) != 1 || b.Checks[0] != check1 {
		t.Fatalf("secrets bucket = %+v, want aesgcm key1 (check %s) × 2", b, check1)
	}

	keys := map[string][]byte{"key1": secret1, "key2": secret2}
	if got, unverified := Check(rep, aesgcmConfig(t, keys, "key2")); len(got) != 1 || len(unverified) != 0 || got[0].Resource != "secrets" || !strings.Contains(got[0].String(), "no such key") {
		t.Fatalf("without key1: %v %v, want the secrets under key1 unreadable", got, unverified)
	}
	if got, unverified := Check(rep, aesgcmConfig(t, keys, "key2", "key1")); len(got) != 0 || len(unverified) != 0 {
		t.Fatalf("with key1: %v %v, want everything readable", got, unverified)
	}
	other := map[string][]byte{"key1": secret2}
	if got, unverified := Check(rep, aesgcmConfig(t, other, "key1")); len(got) != 1 || len(unverified) != 0 || !strings.Contains(got[0].String(), "another secret") {
		t.Fatalf("another secret named key1: %v %v, want unreadable by check value", got, unverified)
	}
}

// Where the key ledger knows no check value for a local key (here: no ledger at all),
// a configuration key of the same name proves nothing: the bucket is reported as "no
// check value known", never as readable, and never matched by name.
func TestNoCheckValueKnownIsNotAMatchByName(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	for k, v := range map[string]string{
		"/registry/secrets/default/a":    "k8s:enc:aesgcm:v1:key1:ciphertext-a",
		"/registry/secrets/default/b":    "k8s:enc:secretbox:v1:box:ciphertext-b",
		"/registry/configmaps/default/c": "plaintext",
	} {
		if _, err := cli.Put(ctx, k, v); err != nil {
			t.Fatal(err)
		}
	}
	path, _ := takeSnapshot(t, cli, "no-ledger.db")
	rep, err := Inventory(ctx, path, Options{Layout: storagelayout.Kube("/registry"), CoordinationPrefix: "/rekey", Read: readOpts()})
	if err != nil {
		t.Fatal(err)
	}
	if rep.Ledger != nil || len(rep.Resources) != 2 {
		t.Fatalf("report = %+v, want configmaps and secrets, no ledger", rep)
	}
	cm, sec := rep.Resources[0], rep.Resources[1]
	if b := cm.Buckets[0]; b.NoCheckValue {
		t.Fatalf("plaintext bucket %+v marked: identity needs no key", b)
	}
	if len(sec.Buckets) != 2 || !sec.Buckets[0].NoCheckValue || !sec.Buckets[1].NoCheckValue || !strings.Contains(sec.Buckets[0].String(), "no check value known") {
		t.Fatalf("secrets buckets = %+v, want both local keys marked no check value known", sec.Buckets)
	}
	cfg := aesgcmConfig(t, map[string][]byte{"key1": secret1}, "key1")
	unreadable, unverified := Check(rep, cfg)
	if len(unverified) != 1 || unverified[0].Bucket.Key != "key1" || !strings.Contains(unverified[0].String(), "no check value known") {
		t.Fatalf("unverified = %v, want aesgcm key1 (named in the configuration) with no check value known", unverified)
	}
	if len(unreadable) != 1 || unreadable[0].Bucket.Provider != "secretbox" || !strings.Contains(unreadable[0].Reason, "no such key") {
		t.Fatalf("unreadable = %v, want the secretbox key the configuration lacks", unreadable)
	}
}
