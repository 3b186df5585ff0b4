package main

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// TestClusterRotationsUnderWriters (E2E_LONG=1): three apiserver shims on one etcd,
// each with its own plugin process on the same token (as three control-plane nodes
// with one HSM), writers on every shim and a sampler reading through every shim. Three
// `rotate` runs: after each, every stored Secret ends under the new version with no
// configuration file edited; 0 failed writes, 0 bad reads.
func TestClusterRotationsUnderWriters(t *testing.T) {
	if os.Getenv("E2E_LONG") == "" {
		t.Skip("set E2E_LONG=1 to run the three-apiserver rotation scenario")
	}
	ctx := t.Context()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	bin := t.TempDir()
	build := exec.CommandContext(ctx, "go", "build", "-ldflags", testbed.VersionLDFlags, "-o", bin+string(filepath.Separator), "./cmd/apiserver-shim", "./hack/tools/etcd")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in %s: %v\n%s", root, err, out)
	}
	dir := t.TempDir()
	etcd, err := testbed.StartEtcd(ctx, filepath.Join(bin, "etcd"), filepath.Join(dir, "etcd"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { etcd.Stop(5 * time.Second) })
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })

	e := newEnv(t)
	e.run(t, "rotate")
	const n, provider, prefix = 3, "hsm", "/pkcs11"
	socks := make([]string, n)
	for i := range n {
		sdir, err := os.MkdirTemp("", "kp")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = os.RemoveAll(sdir) })
		pe := *e
		pe.sock = filepath.Join(sdir, "kms.sock")
		socks[i] = pe.sock
		pe.serve(t)
		waitHealthy(t, pe.client(t), "kek:v1")
	}
	fleet, err := testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: filepath.Join(bin, "apiserver-shim"), Dir: filepath.Join(dir, "shims"), N: n,
		EtcdServers: []string{etcd.Endpoint}, EtcdPrefix: prefix,
		ConfigFor: func(i int) []byte {
			return testbed.SecretsConfig(testbed.KMSv2(provider, "unix://"+socks[i])).Render()
		},
		Args: []string{"--storage-migration-check-interval", "250ms", "--kms-status-interval", "1s",
			"--cluster-coordination=true", "--cluster-lease-ttl", "3s", "--coordination-prefix", "/rekey-pkcs11"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("shim logs:\n%s", fleet.LogTails(3000))
		}
		fleet.Stop()
	})
	configs := map[string][]byte{}
	for _, p := range fleet.ConfigPaths() {
		if configs[p], err = os.ReadFile(p); err != nil {
			t.Fatal(err)
		}
	}
	load := testbed.NewWorkload("pkcs11", fleet.Endpoints())
	if err := load.Seed(ctx, "s", 300, 8); err != nil {
		t.Fatal(err)
	}
	secrets := prefix + "/secrets/"
	if err := testbed.WaitFor(ctx, 200*time.Millisecond, testbed.StoredKeyIDProbe(cli, secrets, provider, "kek:v1")); err != nil {
		t.Fatal(err)
	}
	writers := load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50})
	sampler := load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200})
	for v := 2; v <= 4; v++ {
		start := time.Now()
		e.run(t, "rotate")
		wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		err := testbed.WaitFor(wctx, 200*time.Millisecond, testbed.StoredKeyIDProbe(cli, secrets, provider, fmt.Sprintf("kek:v%d", v)))
		cancel()
		if err != nil {
			t.Fatalf("rotation to v%d: %v", v, err)
		}
		t.Logf("rotation to kek:v%d: every Secret stored under it %v after `rotate`", v, time.Since(start).Round(time.Millisecond))
	}
	wr, sr := writers.Stop(), sampler.Stop()
	t.Logf("writers: %s", wr)
	t.Logf("sampler: %s", sr)
	if wr.Failed() > 0 {
		t.Errorf("%d failed writes, e.g. %v", wr.Failed(), wr.Errors[:min(3, len(wr.Errors))])
	}
	if bad := sr.Total().Bad(); bad > 0 {
		t.Errorf("sampler: %d bad reads, e.g. %v", bad, sr.Examples[:min(5, len(sr.Examples))])
	}
	for _, ep := range fleet.Endpoints() {
		rep, err := load.Verify(ctx, ep)
		if err != nil || !rep.OK() {
			t.Errorf("verify through %s: %v %v", ep.Name(), rep, err)
		}
	}
	// Every Secret is under kek:v4 and every apiserver writes under it: retire lets
	// kek:v1 go, checked through etcd; kek:v4 is what the apiservers write with.
	etcdArgs := []string{"--etcd-servers", etcd.Endpoint, "--etcd-prefix", prefix, "--coordination-prefix", "/rekey-pkcs11"}
	out := e.run(t, append([]string{"retire", "1"}, etcdArgs...)...)
	t.Logf("retire 1: %s", out)
	refused, err := exec.Command(e.bin, append(append([]string{"retire", "4"}, etcdArgs...), e.tokenArgs()...)...).CombinedOutput()
	if err == nil || !bytes.Contains(refused, []byte("refusing to retire version 4")) || !bytes.Contains(refused, []byte("apiserver-0")) {
		t.Fatalf("retire of the version every apiserver writes with: %v\n%s", err, refused)
	}
	for p, before := range configs {
		after, err := os.ReadFile(p)
		if err != nil || !bytes.Equal(after, before) {
			t.Errorf("%s was edited (%v): three rotations must need no configuration edit", p, err)
		}
	}
}
