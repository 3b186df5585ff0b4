package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile/snapshotfiletest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// saveSnapshot writes etcd's snapshot (database and sha256, as etcdctl snapshot save
// writes it) to dir/name.
func saveSnapshot(t *testing.T, cli *clientv3.Client, name string) (string, []byte) {
	t.Helper()
	rc, err := cli.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return writeSnapshotFile(t, name, data), data
}

func writeSnapshotFile(t *testing.T, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// rekeyProcess runs this test binary as the rekey binary (TestMain): its exit status
// and its output.
func rekeyProcess(t *testing.T, args ...string) (int, string) {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe, args...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err = cmd.Run()
	var exit *exec.ExitError
	if errors.As(err, &exit) {
		return exit.ExitCode(), out.String()
	}
	if err != nil {
		t.Fatal(err)
	}
	return 0, out.String()
}

// A corrupt, truncated or hostile snapshot file ends rekey inventory --snapshot with
// "corrupt snapshot: …" and exit status 1, never a runtime fault; a database without
// etcd's hash reads with --skip-hash-check only.
func TestSnapshotInventoryCorruptFileExitsOne(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	for i := range 200 {
		if _, err := cli.Put(context.Background(), "/registry/secrets/default/s"+string(rune('a'+i%26))+string(rune('a'+i/26)), "k8s:enc:aesgcm:v1:key1:"+strings.Repeat("x", 300)); err != nil {
			t.Fatal(err)
		}
	}
	path, snap := saveSnapshot(t, cli, "snapshot.db")
	db := snap[:len(snap)-snapshotfiletest.HashSize]

	if code, out := rekeyProcess(t, "inventory", "--snapshot", path); code != 0 || !strings.Contains(out, "aesgcm") {
		t.Fatalf("intact snapshot: exit %d\n%s", code, out)
	}
	member := writeSnapshotFile(t, "db", db)
	if code, out := rekeyProcess(t, "inventory", "--snapshot", member); code != 1 || !strings.Contains(out, "corrupt snapshot:") || !strings.Contains(out, "--skip-hash-check") {
		t.Fatalf("member database without --skip-hash-check: exit %d, want 1 naming the flag\n%s", code, out)
	}
	if code, out := rekeyProcess(t, "inventory", "--snapshot", member, "--skip-hash-check"); code != 0 || !strings.Contains(out, "not checked (--skip-hash-check)") {
		t.Fatalf("member database with --skip-hash-check: exit %d\n%s", code, out)
	}

	wrongHash := append([]byte(nil), snap...)
	wrongHash[len(wrongHash)-1] ^= 1
	files := map[string][]byte{
		"empty":      nil,
		"truncated":  snap[:len(snap)/2],
		"truncated2": snap[:4096+32],
		"wrong hash": wrongHash,
		"random":     bytes.Repeat([]byte{0x5a, 0xa5, 0x13}, 3000),
	}
	corruptions, err := snapshotfiletest.Corruptions(db)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range corruptions {
		files[c.Name] = snapshotfiletest.WithHash(c.DB) // a hostile file: its hash matches
	}
	for name, data := range files {
		path := writeSnapshotFile(t, "bad.db", data)
		for _, extra := range [][]string{nil, {"--skip-hash-check"}} {
			code, out := rekeyProcess(t, append([]string{"inventory", "--snapshot", path}, extra...)...)
			if name == "wrong hash" && extra != nil {
				continue // the database is intact
			}
			if code != 1 || !strings.Contains(out, "corrupt snapshot: ") || strings.Contains(out, "goroutine ") || strings.Contains(out, "panic") {
				t.Errorf("%s %v: exit %d, want 1 and a corrupt snapshot error\n%s", name, extra, code, out)
			}
		}
	}
}

func TestSkipHashCheckNeedsSnapshot(t *testing.T) {
	if _, err := run(t, "inventory", "--skip-hash-check", "--etcd-servers", "http://127.0.0.1:1"); err == nil || !strings.Contains(err.Error(), "--snapshot only") {
		t.Fatalf("err = %v", err)
	}
}

// Where the snapshot's key ledger knows no check value for a local key, the check
// never matches it by name: the report says "no check value known" per bucket, and
// with a configuration holding a key of that name the command fails, saying it cannot
// tell. With the ledger's check value, the right secret passes and another fails.
func TestSnapshotInventoryNoCheckValueKnown(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	cfgPath := writeConfig(t, "cur.yaml", "key1")
	for _, kv := range [][2]string{
		{"/registry/secrets/default/a", "k8s:enc:aesgcm:v1:key1:ciphertext-a"},
		{"/registry/secrets/default/b", "k8s:enc:aesgcm:v1:key1:ciphertext-b"},
		{"/registry/configmaps/default/c", "plaintext"},
	} {
		if _, err := cli.Put(ctx, kv[0], kv[1]); err != nil {
			t.Fatal(err)
		}
	}
	noLedger, _ := saveSnapshot(t, cli, "no-ledger.db")

	out, err := run(t, "inventory", "--snapshot", noLedger)
	if err != nil || !strings.Contains(out, "no check value known") || !strings.Contains(out, "no key ledger") {
		t.Fatalf("no ledger, no configuration: %v\n%s", err, out)
	}
	out, err = run(t, "inventory", "--snapshot", noLedger, "--encryption-provider-config", cfgPath)
	if err == nil || !strings.Contains(err.Error(), "cannot tell whether") || strings.Contains(out, "OK:") || !strings.Contains(out, "no check value known") {
		t.Fatalf("no ledger, key of the same name: err = %v, want it unverified, not OK\n%s", err, out)
	}
	out, _ = run(t, "inventory", "--snapshot", noLedger, "--encryption-provider-config", cfgPath, "-o", "json")
	var rep struct {
		Report struct {
			Resources []struct {
				Resource string
				Buckets  []struct {
					Key          string
					NoCheckValue bool `json:"noCheckValueKnown"`
				}
			}
		}
		Unreadable []json.RawMessage `json:"unreadable"`
		Unverified []struct {
			Resource string
			Reason   string
		} `json:"noCheckValueKnown"`
	}
	if err := json.NewDecoder(strings.NewReader(out)).Decode(&rep); err != nil { // the error follows
		t.Fatalf("%v\n%s", err, out)
	}
	if len(rep.Unverified) != 1 || rep.Unverified[0].Resource != "secrets" || len(rep.Unreadable) != 0 || !strings.Contains(rep.Unverified[0].Reason, "no check value known") {
		t.Fatalf("json: %+v", rep)
	}
	for _, r := range rep.Report.Resources {
		for _, b := range r.Buckets {
			if b.NoCheckValue != (r.Resource == "secrets") {
				t.Fatalf("%s bucket %+v: noCheckValueKnown wrong", r.Resource, b)
			}
		}
	}

	// With the ledger, the check value decides.
	cfg, err := config.Load(cfgPath, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	var l keyledger.Ledger
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(cfg)}, time.Now(), 1, 0)
	data, _ := json.Marshal(l)
	if _, err := cli.Put(ctx, keyledger.Key("/rekey"), string(data)); err != nil {
		t.Fatal(err)
	}
	withLedger, _ := saveSnapshot(t, cli, "ledger.db")
	if out, err := run(t, "inventory", "--snapshot", withLedger, "--encryption-provider-config", cfgPath); err != nil || !strings.Contains(out, "OK:") || strings.Contains(out, "no check value known") {
		t.Fatalf("ledger, right secret: %v\n%s", err, out)
	}
	other := writeOtherSecretConfig(t)
	if out, err := run(t, "inventory", "--snapshot", withLedger, "--encryption-provider-config", other); err == nil || !strings.Contains(out, "another secret") {
		t.Fatalf("ledger, another secret named key1: err = %v\n%s", err, out)
	}
}

// writeOtherSecretConfig is writeConfig's key1 with another secret.
func writeOtherSecretConfig(t *testing.T) string {
	t.Helper()
	k := make([]byte, 32)
	binary.BigEndian.PutUint64(k, 0xfeedface)
	doc := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n            - {name: key1, secret: " + base64.StdEncoding.EncodeToString(k) + "}\n"
	path := filepath.Join(t.TempDir(), "other.yaml")
	if err := os.WriteFile(path, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
