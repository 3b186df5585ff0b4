package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
)

// fakeApiservers publishes member states for two apiservers that run the configuration
// file as it is (b only once the file has not changed for 200 ms, as a later kubelet
// sync), and plays the migration leader: once both write with the same key, it runs
// `rekey migrate` and records a verified migration. It stands in for the shims of the
// e2e test, which runs the real ones.
type fakeApiservers struct {
	t      *testing.T
	cli    *clientv3.Client
	path   string
	etcd   string
	follow atomic.Bool
	wg     sync.WaitGroup
	stop   context.CancelFunc
}

func startFakeApiservers(t *testing.T, cli *clientv3.Client, path, endpoint string) *fakeApiservers {
	ctx, cancel := context.WithCancel(context.Background())
	f := &fakeApiservers{t: t, cli: cli, path: path, etcd: endpoint, stop: cancel}
	f.follow.Store(true)
	f.wg.Go(func() { f.run(ctx) })
	t.Cleanup(f.Stop)
	return f
}

func (f *fakeApiservers) Stop() {
	f.stop()
	f.wg.Wait()
}

func (f *fakeApiservers) run(ctx context.Context) {
	var lastHash string
	var changed time.Time
	running := map[string]MemberStateFile{}
	migrated := cluster.Key{}
	for ctx.Err() == nil {
		data, err := os.ReadFile(f.path)
		if err == nil && f.follow.Load() {
			hash := config.Hash(data)
			if hash != lastHash {
				lastHash, changed = hash, time.Now()
			}
			cfg, err := config.Parse(data, f.path, config.Options{Reload: true})
			if err != nil {
				f.t.Errorf("fake apiservers: %v", err)
				return
			}
			cur := MemberStateFile{hash: hash}
			for _, rule := range rotation.Rules(cfg) {
				for _, res := range rule.Resources {
					cur.rules = append(cur.rules, cluster.ResourceState{Resource: res, Write: rule.Entries[0], Read: rule.Entries})
				}
			}
			running["a"] = cur
			if time.Since(changed) > 200*time.Millisecond || running["b"].hash == "" {
				running["b"] = cur
			}
			for id, s := range running {
				m := cluster.MemberState{APIServerID: id, ConfigHash: s.hash, Resources: s.rules, PublishedAt: time.Now()}
				v, _ := m.Marshal()
				if err := putMember(ctx, f.cli, id, string(v)); err != nil && ctx.Err() == nil {
					f.t.Errorf("fake apiservers: %v", err)
				}
			}
			if w := running["a"].rules[0].Write; w == running["b"].rules[0].Write && w != migrated {
				if out, err := run(f.t, "migrate", "--encryption-provider-config", f.path, "--etcd-servers", f.etcd, "--progress", "none"); err != nil {
					f.t.Errorf("fake leader: migrate: %v\n%s", err, out)
					return
				}
				st, _ := json.Marshal(cluster.MigrationState{Leader: "a", Records: map[string]cluster.Record{"secrets": {Target: w, Verified: true}}})
				if _, err := f.cli.Put(ctx, cluster.MigrationStateKey(cluster.DefaultPrefix), string(st)); err != nil && ctx.Err() == nil {
					f.t.Errorf("fake leader: %v", err)
				}
				migrated = w
			}
		}
		select {
		case <-ctx.Done():
		case <-time.After(50 * time.Millisecond):
		}
	}
}

// MemberStateFile is what a fake apiserver runs.
type MemberStateFile struct {
	hash  string
	rules []cluster.ResourceState
}

func fileKeys(t *testing.T, path string) []string {
	t.Helper()
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, k := range cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys {
		names = append(names, k.Name)
	}
	return names
}

// TestRotateWait runs `rotate --wait` against apiservers that follow the file: it exits
// 0 only once both edits are written and acknowledged, with every stored Secret under
// the new key; plain output names the stages with timestamps and no key material.
func TestRotateWait(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	seed(t, cli, path, 30)
	startFakeApiservers(t, cli, path, srv.Endpoint)

	out, err := run(t, "rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m")
	if err != nil {
		t.Fatalf("rotate --wait: %v\n%s", err, out)
	}
	t.Logf("rotate --wait output:\n%s", out)
	keys := fileKeys(t, path)
	if len(keys) != 1 || !strings.HasPrefix(keys[0], "key-") {
		t.Fatalf("keys after rotate --wait: %v, want only the new key\n%s", keys, out)
	}
	for _, want := range []string{"starting a new rotation", "stage 1/4 promote", "stage 2/4 migrate", "stage 3/4 remove",
		`removed the read key "key1"`, "stage 4/4 ack", "rotation complete"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if !strings.Contains(out, time.Now().UTC().Format("2006-01-02T")) {
		t.Errorf("plain output has no timestamps:\n%s", out)
	}
	cfg, _ := config.Load(path, config.Options{Reload: true})
	if s := cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys[0].Secret; strings.Contains(out, s) || strings.Contains(out, secret('1')) {
		t.Fatal("rotate --wait printed key material")
	}
	if out, err := run(t, "inventory", "--encryption-provider-config", path, "--etcd-servers", srv.Endpoint); err != nil || !strings.Contains(out, "0 stale") {
		t.Fatalf("inventory after rotate --wait: %v\n%s", err, out)
	}
}

// TestRotateWaitResume: a wait that times out in stage 1 (an apiserver does not follow
// the file) fails saying so; run again, it continues the same rotation instead of adding
// a second new key.
func TestRotateWaitResume(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	seed(t, cli, path, 10)
	f := startFakeApiservers(t, cli, path, srv.Endpoint)
	// Wait until both publish key1, then stop following the file.
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := cli.Get(context.Background(), cluster.MembersPrefix(cluster.DefaultPrefix), clientv3.WithPrefix())
		if err == nil && len(resp.Kvs) == 2 {
			break
		}
		if time.Now().After(deadline) {
			t.Fatal("fake apiservers did not publish")
		}
		time.Sleep(20 * time.Millisecond)
	}
	f.follow.Store(false)
	args := []string{"rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint, "--wait-interval", "50ms"}
	out, err := run(t, append(args, "--wait-timeout", "3s", "--progress", "bar")...)
	if err == nil || !strings.Contains(err.Error(), "stage 1/4 (promote)") || !strings.Contains(err.Error(), "run `rekey rotate --wait` again") ||
		!strings.Contains(err.Error(), "its file does not have the new key yet") {
		t.Fatalf("rotate --wait with apiservers that do not follow: err %v, want a timeout in stage 1/4\n%s", err, out)
	}
	// The bar: one line redrawn in place, with the stage and the apiservers done.
	if !strings.Contains(out, "\r\033[Krotate [1/4 promote] ") || !strings.Contains(out, "0/2 apiservers") {
		t.Errorf("--progress bar drew no progress line:\n%q", out)
	}
	first := fileKeys(t, path)
	if len(first) != 2 || first[1] != "key1" {
		t.Fatalf("keys after the interrupted wait: %v, want [key-… key1]", first)
	}

	f.follow.Store(true)
	out, err = run(t, append(args, "--wait-timeout", "1m", "--progress", "plain")...)
	if err != nil {
		t.Fatalf("resumed rotate --wait: %v\n%s", err, out)
	}
	if !strings.Contains(out, "resuming the rotation in progress") {
		t.Errorf("the second run does not say it resumes:\n%s", out)
	}
	if got := fileKeys(t, path); len(got) != 1 || got[0] != first[0] {
		t.Fatalf("keys after the resumed wait: %v, want only %s (no second new key)", got, first[0])
	}
}

// TestRotateWaitFirstTimeEncryption: --wait --provider aesgcm on a file that writes
// secrets in plaintext encrypts them, migrates, and removes identity at the end.
func TestRotateWaitFirstTimeEncryption(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := filepath.Join(t.TempDir(), "enc.yaml")
	plain := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - identity: {}\n"
	if err := os.WriteFile(path, []byte(plain), 0o600); err != nil {
		t.Fatal(err)
	}
	seed(t, cli, path, 10)
	startFakeApiservers(t, cli, path, srv.Endpoint)
	out, err := run(t, "rotate", "--encryption-provider-config", path, "--wait", "--provider", "aesgcm", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m")
	if err != nil {
		t.Fatalf("rotate --wait --provider aesgcm: %v\n%s", err, out)
	}
	if !strings.Contains(out, "first-time encryption") || !strings.Contains(out, `removed the read key "identity"`) {
		t.Errorf("output lacks the first-time encryption or the removal of identity:\n%s", out)
	}
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	if p := cfg.Encryption.Resources[0].Providers; len(p) != 1 || p[0].AESGCM == nil || len(p[0].AESGCM.Keys) != 1 {
		t.Fatalf("providers after first-time encryption: %d, want one aesgcm key only", len(p))
	}
	if out, err := run(t, "inventory", "--encryption-provider-config", path, "--etcd-servers", srv.Endpoint); err != nil || !strings.Contains(out, "0 stale") {
		t.Fatalf("inventory after first-time encryption: %v\n%s", err, out)
	}
}

// An edit is written only to the file the decision was taken on: when someone else wrote
// the file in between (a second rotate, a pipeline), the edit is refused with
// errFileChanged and the file is left as they wrote it, so two new keys never stack.
// (TestConcurrentRotates shows the check holds against rotates running at once.)
func TestRotateWaitEditsOnlyTheFileItRead(t *testing.T) {
	path := filepath.Join(t.TempDir(), "enc.yaml")
	before := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n      - {name: key1, secret: " + secret(1) + "}\n"
	if err := os.WriteFile(path, []byte(before), 0o600); err != nil {
		t.Fatal(err)
	}
	readHash := config.Hash([]byte(before))
	theirs := strings.Replace(before, "- {name: key1", "- {name: theirs, secret: "+secret(2)+"}\n      - {name: key1", 1)
	if err := os.WriteFile(path, []byte(theirs), 0o600); err != nil {
		t.Fatal(err)
	}
	c := &common{configPath: path}
	read, err := rotation.ParseFile([]byte(before), path)
	if err != nil {
		t.Fatal(err)
	}
	first, err := c.addKey(&cobra.Command{}, read, rotation.Request{Now: time.Now(), Random: rand.Reader})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.replaceFile(t.Context(), readHash, first); !errors.Is(err, errFileChanged) {
		t.Fatalf("first edit of a file changed since it was read: %v, want errFileChanged", err)
	}
	// The second edit, decided on the file the first edit would have written.
	rotated, err := rotation.ParseFile(first.Data, path)
	if err != nil {
		t.Fatal(err)
	}
	second, err := rotation.Remove(rotated, []string{"key1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := c.replaceFile(t.Context(), first.Config.Hash, second); !errors.Is(err, errFileChanged) {
		t.Fatalf("second edit of a file changed since it was read: %v, want errFileChanged", err)
	}
	if got, _ := os.ReadFile(path); string(got) != theirs {
		t.Fatalf("the file was written over:\n%s", got)
	}
}
