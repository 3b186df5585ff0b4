package main

import (
	"bytes"
	"context"
	"crypto/ed25519"
	"crypto/rand"
	"crypto/x509"
	"encoding/base64"
	"encoding/json"
	"encoding/pem"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/evidence"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// writeKeyPair writes a PKCS#8 ed25519 private key and its PKIX public key.
func writeKeyPair(t *testing.T) (privPath, pubPath string) {
	t.Helper()
	pub, priv, err := ed25519.GenerateKey(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	der, err := x509.MarshalPKCS8PrivateKey(priv)
	if err != nil {
		t.Fatal(err)
	}
	pubDER, err := x509.MarshalPKIXPublicKey(pub)
	if err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	privPath, pubPath = filepath.Join(dir, "key.pem"), filepath.Join(dir, "pub.pem")
	if err := os.WriteFile(privPath, pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: der}), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(pubPath, pem.EncodeToMemory(&pem.Block{Type: "PUBLIC KEY", Bytes: pubDER}), 0o600); err != nil {
		t.Fatal(err)
	}
	return privPath, pubPath
}

// Secrets under the write key, one written in plaintext behind the layer's back and
// one under a retired key: the evidence shows both, with the apiservers' configuration
// hashes and the cluster identity; it verifies with the public key, fails with another
// key and fails with a byte changed.
func TestEvidence(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	oldCfg := writeConfig(t, "old.yaml", "key1")
	curCfg := writeConfig(t, "cur.yaml", "key2")
	seedResource(t, cli, oldCfg, "secrets", "retired", 1)
	seedResource(t, cli, curCfg, "secrets", "current", 10)
	seedPlain(t, cli, "secrets", "planted", 1)
	id, err := cluster.EnsureIdentity(ctx, cli, coordination.DefaultPrefix, "/registry", "test", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	member, err := json.Marshal(cluster.MemberState{APIServerID: "apiserver-a", ClusterID: id.ClusterID, ConfigHash: "sha256:not-the-same", PublishedAt: time.Now()})
	if err != nil {
		t.Fatal(err)
	}
	if err := putMember(ctx, cli, "apiserver-a", string(member)); err != nil {
		t.Fatal(err)
	}

	// The key ledger remembers the retired key1 with its check value.
	raw1, err := base64.StdEncoding.DecodeString(secret('1'))
	if err != nil {
		t.Fatal(err)
	}
	check1 := transformers.CheckValue(transformers.AESGCMPrefix, raw1)
	retiredAt := time.Date(2026, 11, 1, 12, 0, 0, 0, time.UTC)
	ledger, err := json.Marshal(keyledger.Ledger{Version: keyledger.Version, Entries: []keyledger.Entry{{
		Provider: "aesgcm", Name: "key1", Check: check1, Prefix: "k8s:enc:aesgcm:v1:key1:",
		FirstUse: keyledger.Event{At: retiredAt.Add(-time.Hour)}, LastUse: keyledger.Event{At: retiredAt.Add(-time.Minute)}, Retired: &keyledger.Event{At: retiredAt},
	}}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, keyledger.Key(coordination.DefaultPrefix), string(ledger)); err != nil {
		t.Fatal(err)
	}

	priv, pub := writeKeyPair(t)
	envPath := filepath.Join(t.TempDir(), "evidence.json")
	cmd := newRootCommand()
	var stdout, stderr bytes.Buffer
	cmd.SetOut(&stdout)
	cmd.SetErr(&stderr)
	cmd.SetArgs([]string{"evidence", "--etcd-servers", srv.Endpoint, "--encryption-provider-config", curCfg, "--signing-key", priv, "--out", envPath})
	if err := cmd.ExecuteContext(ctx); err != nil {
		t.Fatalf("evidence: %v\n%s", err, stderr.String())
	}
	summary := stderr.String()
	t.Logf("evidence summary:\n%s", summary)
	for _, want := range []string{
		"secrets: 1 objects stored in plaintext", "secrets: 2 objects the configuration cannot read",
		"aesgcm/key1 (not in configuration)", "apiserver apiserver-a: sha256:not-the-same (ANOTHER configuration)", id.ClusterID,
	} {
		if !strings.Contains(summary, want) {
			t.Errorf("summary lacks %q:\n%s", want, summary)
		}
	}
	file, err := os.ReadFile(envPath)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(file), secret('1')) || strings.Contains(string(file), secret('2')) {
		t.Fatal("the evidence holds key material")
	}

	out, err := run(t, "evidence", "verify", "--public-key", pub, "-o", "json", envPath)
	if err != nil {
		t.Fatalf("verify: %v\n%s", err, out)
	}
	var p evidence.Predicate
	if err := json.Unmarshal([]byte(out), &p); err != nil {
		t.Fatalf("verify -o json: %v\n%s", err, out)
	}
	if p.Cluster.ID != id.ClusterID || len(p.Resources) != 1 || len(p.APIServers) != 1 || p.APIServers[0].SameConfig {
		t.Fatalf("predicate = %+v", p)
	}
	sec := p.Resources[0]
	if sec.Resource != "secrets" || sec.Objects != 12 || sec.Plaintext != 1 || sec.Unreadable != 2 {
		t.Fatalf("secrets = %+v, want 12 objects, 1 plaintext, 2 unreadable (the plaintext one and the retired key's)", sec)
	}
	byKey := map[string]evidence.Key{}
	for _, k := range sec.Keys {
		byKey[k.Provider+"/"+k.Name] = k
		if k.Provider == "aesgcm" && k.Name == "key2" && (!k.Current || k.Check == "" || !strings.Contains(k.Fingerprint, "check:"+k.Check)) {
			t.Errorf("write key = %+v, want current with its check value", k)
		}
	}
	if k := byKey["aesgcm/key1"]; k.Objects != 1 || k.InConfiguration || k.Unreadable != 1 || k.LedgerCheck != check1 || k.Retired == nil || !k.Retired.Equal(retiredAt) {
		t.Errorf("retired key = %+v, want 1 unreadable object not in the configuration, the ledger's check value %s and retirement %s", k, check1, retiredAt)
	}
	if k := byKey["identity/"]; k.Objects != 1 {
		t.Errorf("plaintext = %+v, want 1 object", k)
	}
	if p.Revision == 0 || p.ConfigHash == "" {
		t.Errorf("revision %d, config hash %q", p.Revision, p.ConfigHash)
	}
	out, err = run(t, "evidence", "verify", "--public-key", pub, envPath)
	if err != nil || !strings.HasPrefix(out, "VERIFIED") || !strings.Contains(out, "1 plaintext") {
		t.Fatalf("verify table: %v\n%s", err, out)
	}

	_, otherPub := writeKeyPair(t)
	if out, err := run(t, "evidence", "verify", "--public-key", otherPub, envPath); err == nil || !strings.Contains(out, "FAILED") {
		t.Fatalf("verify with another key: %v\n%s", err, out)
	}
	// One byte changed fails (internal/evidence changes each byte in turn).
	changed := bytes.Clone(file)
	changed[len(changed)/2] ^= 0x01
	bad := filepath.Join(t.TempDir(), "changed.json")
	if err := os.WriteFile(bad, changed, 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := run(t, "evidence", "verify", "--public-key", pub, bad); err == nil || !strings.Contains(out, "FAILED") {
		t.Fatalf("verify of a changed file: %v\n%s", err, out)
	}
}

// check-config --fips judges the new configuration as apiservers in FIPS 140-3 mode
// do: secretbox is refused naming FIPS and the provider, before etcd is read; without
// --fips the same configuration passes.
func TestCheckConfigFIPS(t *testing.T) {
	srv := etcdtest.Start(t)
	cur := writeConfig(t, "cur.yaml", "key1")
	next := filepath.Join(t.TempDir(), "next.yaml")
	body := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" +
		"      - secretbox:\n          keys:\n            - {name: sb1, secret: " + secret('7') + "}\n" +
		"      - aesgcm:\n          keys:\n            - {name: key1, secret: " + secret('1') + "}\n"
	if err := os.WriteFile(next, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	args := []string{"check-config", "--etcd-servers", srv.Endpoint, "--encryption-provider-config", cur, "--new", next}
	out, err := run(t, append(args, "--fips")...)
	if err == nil || !strings.Contains(err.Error(), "FIPS 140-3") || !strings.Contains(err.Error(), `provider secretbox "sb1"`) {
		t.Fatalf("check-config --fips: err = %v\n%s", err, out)
	}
	if strings.Contains(err.Error(), secret('7')) {
		t.Fatal("the refusal quotes key material")
	}
	out, err = run(t, args...)
	if processFIPSMode() != transformers.FIPSOff {
		// The test runs in FIPS mode (make test-fips): the process's mode refuses
		// without the flag, with the same words.
		if err == nil || !strings.Contains(err.Error(), "FIPS 140-3 mode ("+processFIPSMode().String()+")") || !strings.Contains(err.Error(), `provider secretbox "sb1"`) {
			t.Fatalf("check-config without --fips in FIPS mode %s: err = %v\n%s", processFIPSMode(), err, out)
		}
		return
	}
	if err != nil || !strings.Contains(out, "OK:") {
		t.Fatalf("check-config without --fips: %v\n%s", err, out)
	}
}

// rekey status shows each apiserver's published FIPS mode, "-" for a record that does
// not say.
func TestStatusShowsFIPS(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	on := true
	k := cluster.Key{Provider: "aesgcm", Key: "k1", Check: "c1"}
	for _, m := range []cluster.MemberState{
		{APIServerID: "fips-apiserver", ConfigHash: "sha256:aaaa", FIPS: &on},
		{APIServerID: "old-apiserver", ConfigHash: "sha256:aaaa"},
	} {
		m.PublishedAt = time.Now()
		m.Resources = []cluster.ResourceState{{Resource: "secrets", Write: k, Read: []cluster.Key{k}}}
		data, err := m.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if err := putMember(ctx, cli, m.APIServerID, string(data)); err != nil {
			t.Fatal(err)
		}
	}
	out, err := run(t, "status", "--etcd-servers", srv.Endpoint)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	lines := strings.Split(out, "\n")
	if !strings.Contains(lines[0], "FIPS") {
		t.Fatalf("no FIPS column:\n%s", out)
	}
	col := strings.Index(lines[0], "FIPS")
	for _, l := range lines[1:] {
		switch {
		case strings.HasPrefix(l, "fips-apiserver"):
			if !strings.HasPrefix(l[col:], "on ") {
				t.Errorf("FIPS apiserver row: %q", l)
			}
		case strings.HasPrefix(l, "old-apiserver"):
			if !strings.HasPrefix(l[col:], "-  ") {
				t.Errorf("record without FIPS: %q", l)
			}
		}
	}
}
