package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// recordWrites records in the key ledger that an apiserver writes with cfgPath's keys
// now, as its recorder does.
func recordWrites(t *testing.T, cli *clientv3.Client, cfgPath string) {
	t.Helper()
	cfg, err := config.Load(cfgPath, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	store := keyledger.Store{Client: cli, Key: keyledger.Key(coordination.DefaultPrefix)}
	if _, err := store.Update(t.Context(), func(l *keyledger.Ledger, rev int64) bool {
		return l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(cfg)}, time.Now(), rev, 0)
	}); err != nil {
		t.Fatal(err)
	}
}

// publishRetention publishes a member record of apiserver id with its --backup-retention
// ("" leaves the field out, as an older rekey does).
func publishRetention(t *testing.T, cli *clientv3.Client, id, retention string) {
	t.Helper()
	m := cluster.MemberState{APIServerID: id, ConfigHash: "sha256:00", PublishedAt: time.Now(), BackupRetention: retention}
	v, err := m.Marshal()
	if err != nil {
		t.Fatal(err)
	}
	if err := putMember(t.Context(), cli, id, string(v)); err != nil {
		t.Fatal(err)
	}
}

// Issue 35: `rotate --remove-old` and `check-config` judge with the largest retention
// the apiservers publish, not only their own --backup-retention (default 0): they refuse
// the file the apiservers would refuse, naming the retention, whose it is, the key and
// when it may go.
func TestRemovalHonoursThePublishedRetention(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	seed(t, cli, path, 5)
	recordWrites(t, cli, path)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	if _, err := run(t, "rotate", "--encryption-provider-config", path); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, append([]string{"migrate", "--encryption-provider-config", path, "--progress", "none"}, etcd...)...); err != nil {
		t.Fatal(err)
	}
	publishRetention(t, cli, "a", "720h0m0s")
	publishRetention(t, cli, "b", "1h0m0s")
	data, _ := os.ReadFile(path)
	newKey := fileKeys(t, path)[0]
	// The rotated file without key1: what --remove-old would write.
	if out, err := run(t, "rotate", "--encryption-provider-config", path, "--remove-old", "key1", "-o", "-", "--etcd-servers", srv.Endpoint); err == nil {
		t.Fatalf("rotate --remove-old -o - with apiserver a keeping snapshots 30 days: allowed\n%s", out)
	} else {
		refusal(t, err, "rotate --remove-old")
	}
	if now, _ := os.ReadFile(path); string(now) != string(data) {
		t.Fatal("a refused removal changed the file")
	}
	out, err := run(t, "rotate", "--encryption-provider-config", path, "--remove-old", "key1", "--etcd-servers", srv.Endpoint)
	if err == nil {
		t.Fatalf("rotate --remove-old: allowed\n%s", out)
	}
	refusal(t, err, "rotate --remove-old")
	if keys := fileKeys(t, path); len(keys) != 2 {
		t.Fatalf("keys after the refused removal: %v, want key1 kept", keys)
	}
	finalCfg := removeKeyFromFile(t, path, "key1", filepath.Join(t.TempDir(), "final.yaml"))
	out, err = run(t, "check-config", "--encryption-provider-config", path, "--new", finalCfg, "--etcd-servers", srv.Endpoint)
	if err == nil {
		t.Fatalf("check-config: allowed\n%s", out)
	}
	refusal(t, err, "check-config")

	// The command's own flag, when larger, is the one named.
	_, err = run(t, "check-config", "--encryption-provider-config", path, "--new", finalCfg, "--etcd-servers", srv.Endpoint, "--backup-retention", "1000h")
	if err == nil || !strings.Contains(err.Error(), "(now + --backup-retention 1000h0m0s)") || strings.Contains(err.Error(), "published by") {
		t.Fatalf("check-config --backup-retention 1000h: %v, want its own retention named", err)
	}

	// An apiserver that does not say (an older rekey): refused unless the operator
	// vouches for the retention with the flag.
	for _, id := range []string{"a", "b"} {
		if _, err := cli.Delete(t.Context(), coordination.Member(coordination.DefaultPrefix, id)); err != nil {
			t.Fatal(err)
		}
	}
	publishRetention(t, cli, "old", "")
	_, err = run(t, "check-config", "--encryption-provider-config", path, "--new", finalCfg, "--etcd-servers", srv.Endpoint)
	if err == nil || !strings.Contains(err.Error(), "apiserver old does not publish its --backup-retention") || !strings.Contains(err.Error(), "pass --backup-retention") {
		t.Fatalf("check-config with an apiserver of unknown retention: %v, want refused, saying what to pass", err)
	}
	if out, err := run(t, "rotate", "--encryption-provider-config", path, "--remove-old", "key1", "--etcd-servers", srv.Endpoint, "--backup-retention", "0"); err != nil {
		t.Fatalf("rotate --remove-old --backup-retention 0 with only an apiserver of unknown retention: %v\n%s", err, out)
	}
	if keys := fileKeys(t, path); len(keys) != 1 || keys[0] != newKey {
		t.Fatalf("keys after the removal: %v, want only %s", keys, newKey)
	}
}

// refusal checks a backup-retention refusal of key1 by apiserver a's 720h.
func refusal(t *testing.T, err error, what string) {
	t.Helper()
	for _, want := range []string{"--backup-retention 720h0m0s published by apiserver a", "aesgcm key1 (check ", "keep it until at least " + time.Now().UTC().Add(720*time.Hour).Format("2006-01-02T")} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("%s: refusal does not say %q:\n%v", what, want, err)
		}
	}
	if strings.Contains(err.Error(), "below 0s") {
		t.Errorf("%s: refusal suggests a retention below 0s:\n%v", what, err)
	}
}

// removeKeyFromFile writes to out the configuration of path without the read key name.
func removeKeyFromFile(t *testing.T, path, name, out string) string {
	t.Helper()
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	var keys []string
	for _, k := range cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys {
		if k.Name != name {
			keys = append(keys, "            - {name: "+k.Name+", secret: "+k.Secret+"}\n")
		}
	}
	doc := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n" + strings.Join(keys, "")
	if err := os.WriteFile(out, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return out
}

// Issue 35: `rotate --wait` against apiservers that keep snapshots for an hour (the
// command's own --backup-retention is 0): stage 3 does not write a file they would
// refuse; it fails at once, since the hold outlasts --wait-timeout, naming the
// backup-retention guard, the key and when to run it again.
func TestRotateWaitHonoursThePublishedRetention(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	seed(t, cli, path, 10)
	recordWrites(t, cli, path)
	startFakeApiservers(t, cli, path, srv.Endpoint, publishingRetention("1h0m0s"))

	out, err := run(t, "rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m")
	if err == nil {
		t.Fatalf("rotate --wait removed key1 that the apiservers' 1h retention holds:\n%s", out)
	}
	for _, want := range []string{"stage 3/4 (remove): the backup-retention guard keeps key1 in the file until", "after --wait-timeout ends",
		"--backup-retention 1h0m0s published by apiservers a, b", "run `rekey rotate --wait` again after"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error does not say %q:\n%v", want, err)
		}
	}
	if strings.Contains(err.Error(), "stored objects") {
		t.Errorf("error blames stored objects:\n%v", err)
	}
	if keys := fileKeys(t, path); len(keys) != 2 || keys[1] != "key1" {
		t.Fatalf("keys after the wait: %v, want the new key with key1 behind it", keys)
	}
}
