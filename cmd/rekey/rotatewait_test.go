package main

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
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
	// migrates is what a publishes it migrates (b migrates nothing).
	migrates []string
	// paused keeps the fake leader from migrating.
	paused atomic.Bool
	// retention is the --backup-retention both publish (a string; "0s" unless set).
	retention atomic.Value
	wg        sync.WaitGroup
	stop      context.CancelFunc
}

// startFakeApiservers starts them, with the options applied first (a publishes that it
// migrates secrets unless migrating says otherwise), and returns once both have
// published their records: a command started before that sees a cluster without them.
func startFakeApiservers(t *testing.T, cli *clientv3.Client, path, endpoint string, opts ...func(*fakeApiservers)) *fakeApiservers {
	ctx, cancel := context.WithCancel(context.Background())
	f := &fakeApiservers{t: t, cli: cli, path: path, etcd: endpoint, stop: cancel, migrates: []string{"secrets"}}
	f.follow.Store(true)
	for _, o := range opts {
		o(f)
	}
	f.wg.Go(func() { f.run(ctx) })
	t.Cleanup(f.Stop)
	waitForMembers(t, cli, 2)
	return f
}

// migrating makes a publish that it migrates resources (instead of secrets).
func migrating(resources ...string) func(*fakeApiservers) {
	return func(f *fakeApiservers) { f.migrates = resources }
}

// leaderPaused keeps the fake migration leader from migrating from the start; the test
// lets it go with f.paused.Store(false).
func leaderPaused(f *fakeApiservers) { f.paused.Store(true) }

// publishingRetention makes both publish --backup-retention d.
func publishingRetention(d string) func(*fakeApiservers) {
	return func(f *fakeApiservers) { f.retention.Store(d) }
}

// waitForMembers waits until n member records are published.
func waitForMembers(t *testing.T, cli *clientv3.Client, n int) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for {
		resp, err := cli.Get(context.Background(), coordination.MembersPrefix(coordination.DefaultPrefix), clientv3.WithPrefix())
		if err == nil && len(resp.Kvs) == n {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("the fake apiservers did not publish %d member records within 10s (%v)", n, err)
		}
		time.Sleep(10 * time.Millisecond)
	}
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
				retention, _ := f.retention.Load().(string)
				if retention == "" {
					retention = "0s"
				}
				m := cluster.MemberState{APIServerID: id, ConfigHash: s.hash, Resources: s.rules, PublishedAt: time.Now(),
					StorageMigration: &cluster.StorageMigrationState{}, BackupRetention: retention}
				if id == "a" {
					m.StorageMigration.Resources = f.migrates
				}
				v, _ := m.Marshal()
				if err := putMember(ctx, f.cli, id, string(v)); err != nil && ctx.Err() == nil {
					f.t.Errorf("fake apiservers: %v", err)
				}
			}
			if w := running["a"].rules[0].Write; w == running["b"].rules[0].Write && w != migrated && slices.Contains(f.migrates, "secrets") && !f.paused.Load() {
				if out, err := run(f.t, "migrate", "--encryption-provider-config", f.path, "--etcd-servers", f.etcd, "--progress", "none"); err != nil {
					f.t.Errorf("fake leader: migrate: %v\n%s", err, out)
					return
				}
				st, _ := json.Marshal(cluster.MigrationState{Leader: "a", Records: map[string]cluster.Record{"secrets": {Target: w, Verified: true}}})
				if _, err := f.cli.Put(ctx, coordination.MigrationState(coordination.DefaultPrefix), string(st)); err != nil && ctx.Err() == nil {
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
	noStaleLeft(t, path, srv.Endpoint, "inventory after rotate --wait")
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
	// Both publish key1 (startFakeApiservers waited for that); now stop following the file.
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
// secrets in plaintext encrypts them, migrates, and with --remove-identity-fallback
// removes identity at the end.
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
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m", "--remove-identity-fallback")
	if err != nil {
		t.Fatalf("rotate --wait --provider aesgcm: %v\n%s", err, out)
	}
	if !strings.Contains(out, "first-time encryption") || !strings.Contains(out, "the inventory counts 10 of 10 objects of secrets stored as plaintext") ||
		!strings.Contains(out, `removed the read key "identity"`) {
		t.Errorf("output lacks the first-time encryption or the removal of identity:\n%s", out)
	}
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	if p := cfg.Encryption.Resources[0].Providers; len(p) != 1 || p[0].AESGCM == nil || len(p[0].AESGCM.Keys) != 1 {
		t.Fatalf("providers after first-time encryption: %d, want one aesgcm key only", len(p))
	}
	noStaleLeft(t, path, srv.Endpoint, "inventory after first-time encryption")
}

// An edit is written only to the file the decision was taken on: when someone else wrote
// the file in between (a second rotate, a pipeline), the edit is refused with
// configsource.ErrChanged and the file is left as they wrote it, so two new keys never stack.
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
	c := &common{src: sourceFlags{configPath: path}}
	read, err := rotation.ParseFile([]byte(before), path)
	if err != nil {
		t.Fatal(err)
	}
	first, err := c.addKey(context.Background(), io.Discard, read, rotation.Request{Now: time.Now(), Random: rand.Reader})
	if err != nil {
		t.Fatal(err)
	}
	if err := c.replaceSource(t.Context(), sourced{File: read, version: readHash}, first); !errors.Is(err, configsource.ErrChanged) {
		t.Fatalf("first edit of a file changed since it was read: %v, want configsource.ErrChanged", err)
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
	if err := c.replaceSource(t.Context(), sourced{File: rotated, version: first.Config.Hash}, second); !errors.Is(err, configsource.ErrChanged) {
		t.Fatalf("second edit of a file changed since it was read: %v, want configsource.ErrChanged", err)
	}
	if got, _ := os.ReadFile(path); string(got) != theirs {
		t.Fatalf("the file was written over:\n%s", got)
	}
}

// identityConfig writes a configuration whose secrets rule writes with aesgcm keys, in
// order, and has identity behind them (none: identity only).
func identityConfig(t *testing.T, path string, keys ...string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n")
	if len(keys) > 0 {
		b.WriteString("      - aesgcm:\n          keys:\n")
		for _, k := range keys {
			fmt.Fprintf(&b, "            - {name: %s, secret: %s}\n", k, secret(k[len(k)-1]))
		}
	}
	b.WriteString("      - identity: {}\n")
	if err := os.WriteFile(path, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
}

// secretsProviders describes the secrets rule of the file at path: "aesgcm(<keys>)",
// "identity", in order.
func secretsProviders(t *testing.T, path string) string {
	t.Helper()
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, p := range cfg.Encryption.Resources[0].Providers {
		switch {
		case p.AESGCM != nil:
			var names []string
			for _, k := range p.AESGCM.Keys {
				names = append(names, k.Name)
			}
			out = append(out, "aesgcm("+strings.Join(names, ",")+")")
		case p.Identity != nil:
			out = append(out, "identity")
		default:
			out = append(out, "other")
		}
	}
	return strings.Join(out, ", ")
}

// TestRotateWaitKeepsTheIdentityFallback: [aesgcm key1, identity], the shape upstream's
// documentation shows. While plaintext Secrets are stored, rotate --wait finishes the
// first-time encryption (no new key); once none is, it runs a new rotation that ends
// with [<new>, identity], identity kept as the fallback.
func TestRotateWaitKeepsTheIdentityFallback(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := filepath.Join(t.TempDir(), "enc.yaml")
	identityConfig(t, path)
	seed(t, cli, path, 10) // 10 plaintext Secrets
	identityConfig(t, path, "key1")
	seed(t, cli, path, 4) // 4 of them now under key1: 6 plaintext left
	// The leader waits until rotate --wait has taken its inventory.
	f := startFakeApiservers(t, cli, path, srv.Endpoint, leaderPaused)
	time.AfterFunc(time.Second, func() { f.paused.Store(false) })
	args := []string{"rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m"}
	out, err := run(t, args...)
	if err != nil {
		t.Fatalf("rotate --wait with plaintext left: %v\n%s", err, out)
	}
	if !strings.Contains(out, "resuming the first-time encryption in progress: the inventory counts 6 objects of secrets still stored as plaintext") ||
		!strings.Contains(out, "identity stays behind it as the fallback") {
		t.Errorf("output does not say it finishes the first-time encryption and keeps identity:\n%s", out)
	}
	if got := secretsProviders(t, path); got != "aesgcm(key1), identity" {
		t.Fatalf("providers after the first-time encryption: %s, want aesgcm(key1), identity (no new key, identity kept)", got)
	}

	out, err = run(t, args...)
	if err != nil {
		t.Fatalf("rotate --wait with nothing stale: %v\n%s", err, out)
	}
	t.Logf("rotate --wait output:\n%s", out)
	if !strings.Contains(out, "starting a new rotation") || strings.Contains(out, "resuming") {
		t.Errorf("[key1, identity] with nothing stale is not a new rotation:\n%s", out)
	}
	keys := fileKeys(t, path)
	if got := secretsProviders(t, path); len(keys) != 1 || !strings.HasPrefix(keys[0], "key-") || got != "aesgcm("+keys[0]+"), identity" {
		t.Fatalf("providers after the rotation: %s, want aesgcm(<new key>), identity", got)
	}
	noStaleLeft(t, path, srv.Endpoint, "inventory after rotate --wait")
}

// TestRotateWaitRefusesARotationNobodyMigrates: no live apiserver migrates secrets (a
// migrates configmaps only, b nothing), so the rotation could never finish: refused
// before the first edit, naming the flags to set.
func TestRotateWaitRefusesARotationNobodyMigrates(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	seed(t, cli, path, 5)
	startFakeApiservers(t, cli, path, srv.Endpoint, migrating("configmaps"))
	start := time.Now()
	out, err := run(t, "rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m")
	if err == nil || !strings.Contains(err.Error(), "no live apiserver migrates secrets") || !strings.Contains(err.Error(), "--storage-migration=true") ||
		!strings.Contains(err.Error(), "--storage-migration-resources") || !strings.Contains(err.Error(), "nothing was edited") {
		t.Fatalf("rotate --wait nobody migrates: err %v, want the refusal naming --storage-migration\n%s", err, out)
	}
	if time.Since(start) > 20*time.Second {
		t.Errorf("the refusal took %s: it must come up front, not at the timeout", time.Since(start))
	}
	if keys := fileKeys(t, path); len(keys) != 1 || keys[0] != "key1" {
		t.Fatalf("keys after the refusal: %v, want the file untouched", keys)
	}
}

// TestRotateWaitRemoveIdentityFallbackNeedsWait: the flag belongs to --wait's second
// edit; step by step, --remove-old identity does it.
func TestRotateWaitRemoveIdentityFallbackNeedsWait(t *testing.T) {
	path := writeConfig(t, "enc.yaml", "key1")
	if _, err := run(t, "rotate", "--encryption-provider-config", path, "--remove-identity-fallback", "-o", "-"); err == nil || !strings.Contains(err.Error(), "--remove-old identity") {
		t.Fatalf("--remove-identity-fallback without --wait: %v, want a refusal pointing at --remove-old identity", err)
	}
}

// noStaleLeft fails unless `rekey inventory` counts no stale object under the file at
// path (after says after what).
func noStaleLeft(t *testing.T, path, endpoint, after string) {
	t.Helper()
	if out, err := run(t, "inventory", "--encryption-provider-config", path, "--etcd-servers", endpoint); err != nil || !strings.Contains(out, "0 stale") {
		t.Fatalf("%s: %v\n%s", after, err, out)
	}
}
