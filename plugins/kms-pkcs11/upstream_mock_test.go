package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/testbed"
)

// TestRotationAgainstUpstreamMock (REKEY_BENCH_UPSTREAM_MOCK=1, make
// bench-kms-pkcs11-rotation) measures the same KMS v2 key rotation of N Secrets on
// three apiserver shims (rekey's layer, one etcd, writers and a sampler on every shim)
// twice in one run, each side on a fresh testbed:
//
//   - rekey: one rekey-kms-pkcs11 process serves every shim; `rekey-kms-pkcs11 rotate`
//     issues kek:v2 on the token (no configuration edit); timed until every stored
//     Secret is under kek:v2.
//   - upstream: upstream's mock PKCS#11 plugin (k8s.io/kms/plugins/mock, built from
//     upstream's source by hack/build-upstream-mock-kms.sh) holds one key ("kms-test")
//     per process, so a rotation is the two-plugin procedure: a second process on a
//     second token with its own key, then `rekey rotate --wait --provider kms` (provider
//     B first, every apiserver writes with it, every object rewritten and verified,
//     provider A removed, every apiserver runs the final file); timed from the first
//     edit of the source file until rotate --wait exits 0, and until every stored
//     Secret is under B.
//
// The shims' config files are copies of one source file that a kubelet-like syncer
// updates after a random delay per file (0 to REKEY_BENCH_SYNC_DELAY, default 10s, as
// in the rotation scenario of rekey-bench). REKEY_BENCH_SECRETS sets N (default 2,000).
// The figures are logged as one table; docs/bench/appendix.md keeps them.
func TestRotationAgainstUpstreamMock(t *testing.T) {
	if os.Getenv("REKEY_BENCH_UPSTREAM_MOCK") == "" {
		t.Skip("set REKEY_BENCH_UPSTREAM_MOCK=1 (make bench-kms-pkcs11-rotation) to run the rotation against upstream's mock plugin")
	}
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	mock := os.Getenv("UPSTREAM_MOCK_KMS_PLUGIN")
	if mock == "" {
		mock = filepath.Join(root, "bin", "upstream-mock-kms-plugin")
	}
	if _, err := os.Stat(mock); err != nil {
		t.Fatalf("upstream's mock plugin: %v; build it with hack/build-upstream-mock-kms.sh (make bench-kms-pkcs11-rotation does)", err)
	}
	n := envInt(t, "REKEY_BENCH_SECRETS", 2000)
	delay := 10 * time.Second
	if v := os.Getenv("REKEY_BENCH_SYNC_DELAY"); v != "" {
		if delay, err = time.ParseDuration(v); err != nil {
			t.Fatalf("REKEY_BENCH_SYNC_DELAY=%q: %v", v, err)
		}
	}
	ctx := t.Context()
	bin := t.TempDir()
	build := exec.CommandContext(ctx, "go", "build", "-ldflags", testbed.VersionLDFlags, "-o", bin+string(filepath.Separator), "./cmd/apiserver-shim", "./hack/tools/etcd", "./cmd/rekey")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build in %s: %v\n%s", root, err, out)
	}
	e := newEnv(t) // rekey's token; SOFTHSM2_CONF now names its directory
	t.Logf("%d Secrets, 3 shims, config files synced after 0-%v each", n, delay)

	rk := rotateWithRekeyPlugin(t, bin, e, n, delay)
	up := rotateWithUpstreamMock(t, bin, mock, e, n, delay)

	ratio := func(a, b time.Duration) string {
		if a <= 0 {
			return "-"
		}
		return fmt.Sprintf("x%.1f", b.Seconds()/a.Seconds())
	}
	var tab strings.Builder
	fmt.Fprintf(&tab, "| | rekey-kms-pkcs11 (one process) | upstream mock (two-plugin procedure) | upstream / rekey |\n|---|---:|---:|---:|\n")
	row := func(name, a, b, r string) { fmt.Fprintf(&tab, "| %s | %s | %s | %s |\n", name, a, b, r) }
	row("from the procedure's start (rekey: `rotate`; upstream: plugin B started) to every Secret under the new key", sec(rk.underNew), sec(up.underNew), ratio(rk.underNew, up.underNew))
	row("from the procedure's start to its end (rekey: as above; upstream: provider A removed everywhere)", sec(rk.done), sec(up.done), ratio(rk.done, up.done))
	row("upstream: from the first edit to provider A removed everywhere", "-", sec(up.fromEdit), "")
	row("plugin processes serving during the rotation", strconv.Itoa(rk.processes), strconv.Itoa(up.processes), "")
	row("plugin processes started for the rotation", "0 (one `rotate` command run)", strconv.Itoa(up.processes-1), "")
	row("edits of the configuration file", strconv.Itoa(rk.edits), strconv.Itoa(up.edits), "")
	row("apiserver restarts", strconv.Itoa(rk.restarts), strconv.Itoa(up.restarts), "")
	row("failed client requests (writes + reads)", rk.failed(), up.failed(), "")
	row("unreadable reads", strconv.FormatInt(rk.unreadable, 10), strconv.FormatInt(up.unreadable, 10), "")
	row("stored Secrets under the new key at the end", rk.under, up.under, "")
	t.Logf("results:\n%s", tab.String())
	for _, s := range []*mockRotation{rk, up} {
		if s.failedWrites+s.failedReads+s.unreadable > 0 {
			t.Errorf("%s: %s failed requests, %d unreadable reads", s.side, s.failed(), s.unreadable)
		}
	}
}

// mockRotation is what one side measured.
type mockRotation struct {
	side string
	// underNew is until every stored Secret was under the new key, done until the
	// side's procedure ended.
	underNew, done time.Duration
	// fromEdit is from the first edit of the source file to the end (upstream).
	fromEdit                              time.Duration
	processes, edits, restarts            int
	failedWrites, failedReads, unreadable int64
	acked, reads                          int64
	under                                 string
}

func (r *mockRotation) failed() string {
	return fmt.Sprintf("%d (%d writes of %d, %d reads of %d)", r.failedWrites+r.failedReads, r.failedWrites, r.acked+r.failedWrites, r.failedReads, r.reads)
}

func sec(d time.Duration) string { return fmt.Sprintf("%.1f s", d.Seconds()) }

func envInt(t *testing.T, name string, def int) int {
	t.Helper()
	v := os.Getenv(name)
	if v == "" {
		return def
	}
	n, err := strconv.Atoi(v)
	if err != nil || n <= 0 {
		t.Fatalf("%s=%q: want a positive number", name, v)
	}
	return n
}

// mockBed is one side's fresh testbed: one etcd, three shims with coordination on,
// a source file followed by a syncer, N seeded Secrets, writers and a sampler.
type mockBed struct {
	cli      *clientv3.Client
	etcd     string
	fleet    *testbed.Fleet
	source   string
	follower *testbed.SourceFollower
	load     *testbed.Workload
	writers  *testbed.Writers
	sampler  *testbed.Sampler
}

const (
	mockPrefix = "/registry"
	mockCoord  = "/rekey"
)

func startMockBed(t *testing.T, bin, side string, initial []byte, n int, delay time.Duration) *mockBed {
	t.Helper()
	ctx := t.Context()
	dir := t.TempDir()
	etcd, err := testbed.StartEtcd(ctx, filepath.Join(bin, "etcd"), filepath.Join(dir, "etcd"))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { etcd.Stop(5 * time.Second) })
	b := &mockBed{etcd: etcd.Endpoint}
	if b.cli, err = testbed.EtcdClient([]string{etcd.Endpoint}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = b.cli.Close() })
	b.fleet, err = testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: filepath.Join(bin, "apiserver-shim"), Dir: filepath.Join(dir, "shims"), N: 3,
		EtcdServers: []string{etcd.Endpoint}, EtcdPrefix: mockPrefix, Config: initial,
		Args: []string{"--storage-migration-check-interval", "250ms", "--kms-status-interval", "1s",
			"--cluster-coordination=true", "--cluster-lease-ttl", "3s", "--coordination-prefix", mockCoord},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("%s: shim logs:\n%s", side, b.fleet.LogTails(3000))
		}
		b.fleet.Stop()
	})
	syncer, err := b.fleet.NewSyncer(testbed.SyncerConfig{MaxDelay: delay, Logf: func(format string, args ...any) {
		t.Logf(side+": "+format, args...)
	}})
	if err != nil {
		t.Fatal(err)
	}
	b.source = filepath.Join(dir, "source.yaml")
	if err := os.WriteFile(b.source, initial, 0o600); err != nil {
		t.Fatal(err)
	}
	b.load = testbed.NewWorkload("pkcs11", b.fleet.Endpoints())
	start := time.Now()
	if err := b.load.Seed(ctx, "s", n, 8); err != nil {
		t.Fatal(err)
	}
	t.Logf("%s: %d Secrets seeded in %v", side, n, time.Since(start).Round(time.Millisecond))
	b.follower = testbed.FollowSource(ctx, b.source, initial, syncer)
	b.writers = b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50})
	b.sampler = b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200})
	time.Sleep(3 * time.Second) // the load runs before the rotation starts
	return b
}

// finish stops the load and the follower, checks that every acknowledged write reads
// back through every shim and fills r's counts.
func (b *mockBed) finish(t *testing.T, r *mockRotation) {
	t.Helper()
	wr, sr := b.writers.Stop(), b.sampler.Stop()
	b.follower.Stop()
	t.Logf("%s: writers: %s", r.side, wr)
	t.Logf("%s: sampler: %s", r.side, sr)
	tot := sr.Total()
	r.acked, r.failedWrites = wr.Acked(), wr.Failed()
	r.reads, r.failedReads, r.unreadable = tot.Reads, tot.Errors+tot.Missing+tot.Stale, tot.Unreadable
	r.edits = len(b.follower.Rounds())
	for _, s := range b.fleet.Shims {
		if !s.Alive() {
			t.Errorf("%s: %s is not running", r.side, s.ID)
		}
	}
	for _, ep := range b.fleet.Endpoints() {
		rep, err := b.load.Verify(t.Context(), ep)
		if err != nil || !rep.OK() {
			t.Errorf("%s: verify through %s: %v %v", r.side, ep.Name(), rep, err)
		}
	}
}

// storedUnder waits until every stored Secret is under provider:keyID.
func (b *mockBed) storedUnder(ctx context.Context, provider, keyID string) error {
	wctx, cancel := context.WithTimeout(ctx, 15*time.Minute)
	defer cancel()
	return testbed.WaitFor(wctx, 200*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, mockPrefix+"/secrets/", provider, keyID))
}

// storedText says how many stored Secrets are under provider:keyID, of all.
func (b *mockBed) storedText(ctx context.Context, provider, keyID string) string {
	got, err := testbed.StoredKMSKeyIDs(ctx, b.cli, mockPrefix+"/secrets/")
	if err != nil {
		return err.Error()
	}
	all := 0
	for _, n := range got {
		all += n
	}
	return fmt.Sprintf("%d of %d (%s:%s)", got["k8s:enc:kms:v2:"+provider+":"+keyID], all, provider, keyID)
}

func rotateWithRekeyPlugin(t *testing.T, bin string, e *env, n int, delay time.Duration) *mockRotation {
	ctx := t.Context()
	r := &mockRotation{side: "rekey"}
	e.run(t, "rotate")
	e.serve(t)
	r.processes = 1
	waitHealthy(t, e.client(t), "kek:v1")
	b := startMockBed(t, bin, r.side, testbed.SecretsConfig(testbed.KMSv2("hsm", "unix://"+e.sock)).Render(), n, delay)
	if err := b.storedUnder(ctx, "hsm", "kek:v1"); err != nil {
		t.Fatal(err)
	}
	start := time.Now()
	t.Logf("rekey: rotate: %s", strings.TrimSpace(e.run(t, "rotate")))
	if err := b.storedUnder(ctx, "hsm", "kek:v2"); err != nil {
		t.Fatalf("rekey: %v", err)
	}
	r.underNew = time.Since(start)
	r.done = r.underNew
	t.Logf("rekey: every Secret under kek:v2 %v after `rotate`", r.underNew.Round(time.Millisecond))
	b.finish(t, r)
	r.under = b.storedText(ctx, "hsm", "kek:v2")
	return r
}

// mockToken initialises a SoftHSM2 token labelled label in SOFTHSM2_CONF's directory
// with one AES-256 key labelled "kms-test", as upstream's manifest (kms.yaml) does,
// and writes the mock plugin's config file (crypto11's JSON) for it.
func mockToken(t *testing.T, e *env, label string) string {
	t.Helper()
	const pin = "1234-mock"
	for _, args := range [][]string{
		{"softhsm2-util", "--init-token", "--free", "--label", label, "--pin", pin, "--so-pin", pin},
		{"pkcs11-tool", "--module", e.h.Module, "--keygen", "--key-type", "aes:32", "--pin", pin, "--token-label", label, "--label", "kms-test"},
	} {
		if out, err := exec.Command(args[0], args[1:]...).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", strings.Join(args, " "), err, out)
		}
	}
	cfg := filepath.Join(t.TempDir(), label+".json")
	body := fmt.Sprintf(`{"Path": %q, "TokenLabel": %q, "Pin": %q}`, e.h.Module, label, pin)
	if err := os.WriteFile(cfg, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	return cfg
}

// startMock starts upstream's mock plugin on the token of cfg and waits until it is
// healthy.
func startMock(t *testing.T, mock, cfg, name string) string {
	t.Helper()
	dir, err := os.MkdirTemp("", "km")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	sock := filepath.Join(dir, "kms.sock")
	cmd := exec.Command(mock, "-listen-addr", "unix://"+sock, "-config-file-path", cfg)
	logs := &syncBuffer{}
	cmd.Stdout, cmd.Stderr = logs, logs
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
		if t.Failed() {
			t.Logf("mock plugin %s log:\n%s", name, logs.String())
		}
	})
	waitHealthy(t, (&env{sock: sock}).client(t), "kms-test")
	return sock
}

func rotateWithUpstreamMock(t *testing.T, bin, mock string, e *env, n int, delay time.Duration) *mockRotation {
	ctx := t.Context()
	r := &mockRotation{side: "upstream"}
	cfgA, cfgB := mockToken(t, e, "mock-a"), mockToken(t, e, "mock-b")
	sockA := startMock(t, mock, cfgA, "A")
	r.processes = 1
	b := startMockBed(t, bin, r.side, testbed.SecretsConfig(testbed.KMSv2("mocka", "unix://"+sockA)).Render(), n, delay)
	if err := b.storedUnder(ctx, "mocka", "kms-test"); err != nil {
		t.Fatal(err)
	}
	// The procedure: a second plugin process on a second token with its own key, then
	// provider B first, every object rewritten, provider A removed (rekey rotate --wait).
	start := time.Now()
	sockB := startMock(t, mock, cfgB, "B")
	r.processes++
	bStarted := time.Since(start)
	under := make(chan time.Duration, 1)
	go func() {
		if err := b.storedUnder(ctx, "mockb", "kms-test"); err != nil {
			under <- -1
			return
		}
		under <- time.Since(start)
	}()
	cmd := exec.CommandContext(ctx, filepath.Join(bin, "rekey"), "rotate", "--encryption-provider-config", b.source, "--wait",
		"--provider", "kms", "--kms-name", "mockb", "--kms-endpoint", "unix://"+sockB,
		"--etcd-servers", b.etcd, "--etcd-prefix", mockPrefix, "--coordination-prefix", mockCoord, "--progress", "plain")
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			t.Logf("upstream: rekey rotate: %s", sc.Text())
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Run()
	exited := time.Now()
	_ = pw.Close()
	<-copied
	if err != nil {
		t.Fatalf("upstream: rekey rotate --wait: %v", err)
	}
	rounds := b.follower.Rounds()
	if len(rounds) == 0 {
		t.Fatal("upstream: the source file was never edited")
	}
	first := rounds[0].Detected
	r.done, r.fromEdit = exited.Sub(start), exited.Sub(first)
	if r.underNew = <-under; r.underNew < 0 {
		t.Fatalf("upstream: not every Secret under mockb: %s", b.storedText(ctx, "mockb", "kms-test"))
	}
	t.Logf("upstream: plugin B healthy %v after its start, first edit %v after it; every Secret under mockb %v, provider A removed everywhere %v after B's start (%v after the first edit)",
		bStarted.Round(time.Millisecond), first.Sub(start).Round(time.Millisecond), r.underNew.Round(time.Millisecond), r.done.Round(time.Millisecond), r.fromEdit.Round(time.Millisecond))
	final, err := os.ReadFile(b.source)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(final), "mocka") {
		t.Errorf("upstream: the final configuration still names provider A:\n%s", final)
	}
	b.finish(t, r)
	r.under = b.storedText(ctx, "mockb", "kms-test")
	return r
}
