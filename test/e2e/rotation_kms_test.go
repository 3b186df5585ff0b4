package e2e

// The KMS → KMS runbook in one command: the move from one KMS v2
// plugin (key vault) to another that the Azure KMS runbook does in eight steps and two
// restarts, done with `rekey rotate` on the three-shim testbed while writers run.
//
// Every node runs its own pair of plugins, as the runbook runs a plugin static pod per
// control-plane node and a second one on its own socket: plugin A (the old provider,
// keyring kek-1) and plugin B (the new one, keyring kek-b), the same keyring on every
// node, as every node's plugin talks to the same key vault. On a real cluster the
// socket path is the same on every node and the configuration file too; the testbed's
// nodes share one file system, so each node's sockets live in their own directory and
// the syncer, which plays the kubelets, writes each node the operator's file with the
// socket paths pointing at that node's plugins. The operator runs rekey on node 0
// (its file, its sockets).

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
)

// runRekey runs the rekey CLI and returns its combined output.
func runRekey(t testing.TB, args ...string) (string, error) {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 60*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, rekeyBin(t), args...).CombinedOutput()
	t.Logf("$ rekey %s\n%s", strings.Join(args, " "), out)
	return string(out), err
}

const (
	storedKMSA = "k8s:enc:kms:v2:kms-a:"
	storedKMSB = "k8s:enc:kms:v2:kms-b:"
)

func TestRotationKMSToKMS(t *testing.T) {
	requireClusterShim(t)
	start := time.Now()
	const objects = 300
	// plugins: one plugin A per node (kek-1); the bed's initial config writes with kms-a.
	b := newClusterBed(t, bedConfig{name: "rotation-kms", objects: objects, coordination: true, plugins: true,
		minDelay: time.Second, maxDelay: 4 * time.Second,
		initial: func(b *clusterBed, i int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.KMSv2("kms-a", b.plugins[i].Endpoint))
		}})
	ctx := t.Context()
	pluginsA := b.plugins
	var processes []*testbed.Shim // no apiserver restarts: the same processes at the end
	for _, s := range b.fleet.Shims {
		processes = append(processes, s.Current())
	}

	// Plugin B on every node: its own socket, its own keyring (another key vault).
	kekB := testbed.PluginKey{Name: "kek-b", Secret: testbed.RandomKey()}
	sockRootB := shortTempDir(t)
	var pluginsB []*testbed.Plugin
	for i := range pluginsA {
		pdir, sock := filepath.Join(t.TempDir(), "plugin-b"), filepath.Join(sockRootB, strconv.Itoa(i))
		for _, d := range []string{pdir, sock} {
			if err := os.MkdirAll(d, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		p, err := testbed.StartPlugin(ctx, bins.Plugin, pdir, sock, kekB)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { p.Stop(5 * time.Second) })
		pluginsB = append(pluginsB, p)
	}
	// forNode is node i's copy of the operator's file: node 0's sockets are node i's.
	forNode := func(src []byte) func(i int) []byte {
		return func(i int) []byte {
			s := strings.ReplaceAll(string(src), pluginsA[0].Endpoint, pluginsA[i].Endpoint)
			return []byte(strings.ReplaceAll(s, pluginsB[0].Endpoint, pluginsB[i].Endpoint))
		}
	}

	// The operator's file: node 0's, as the bed started every node.
	src := filepath.Join(t.TempDir(), "encryption.yaml")
	if err := os.WriteFile(src, testbed.SecretsConfig(testbed.KMSv2("kms-a", pluginsA[0].Endpoint)).Render(), 0o600); err != nil {
		t.Fatal(err)
	}
	etcdFlags := []string{"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--etcd-prefix", b.prefix}
	wctx, cancel := contextWithTimeout(t, 30*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.StoredUnderProbe(b.cli, b.secretsKey, storedKMSA)); err != nil {
		t.Fatal(err)
	}
	l := b.startLoad()
	time.Sleep(time.Second) // writers under way on every shim before the switch

	// Step 1: kms-b first, kms-a kept for reads.
	if out, err := runRekey(t, "rotate", "--encryption-provider-config", src,
		"--provider", "kms", "--kms-name", "kms-b", "--kms-endpoint", pluginsB[0].Endpoint); err != nil {
		t.Fatalf("rotate --provider kms: %v\n%s", err, out)
	}
	added, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	// An early removal is refused while Secrets are still under kms-a. It runs before
	// any node gets the new file, so no migration can have begun however slow the
	// machine is (an operator who runs it right after step 1 sees the same).
	out, err := runRekey(t, append([]string{"rotate", "--encryption-provider-config", src, "--remove-old", "kms-a"}, etcdFlags...)...)
	var exit *exec.ExitError
	if !errors.As(err, &exit) {
		t.Fatalf("early --remove-old kms-a: err = %v, want a refusal (non-zero exit)\n%s", err, out)
	}
	refused := regexp.MustCompile(`secrets: (\d+) objects are stored under [^\n]*kms-a`).FindStringSubmatch(out)
	if refused == nil || !strings.Contains(out, "still encrypts stored data") {
		t.Fatalf("early --remove-old kms-a: the refusal does not name secrets, kms-a and a count:\n%s", out)
	}
	if n, _ := strconv.Atoi(refused[1]); n == 0 {
		t.Errorf("the guard refused with 0 Secrets under kms-a")
	}
	if now, _ := os.ReadFile(src); string(now) != string(added) {
		t.Fatal("the refused removal changed the file")
	}

	edited := time.Now()
	round := b.syncer.ApplyEach(ctx, forNode(added), nil)

	// The cluster converges: every node loaded its copy, every Secret is on kms-b, and
	// the migration leader verified it.
	last, err := round.Wait(ctx)
	if err != nil {
		t.Fatal(err)
	}
	cctx, cancel := contextWithTimeout(t, 45*time.Second)
	defer cancel()
	err = testbed.WaitFor(cctx, 200*time.Millisecond,
		testbed.StoredUnderProbe(b.cli, b.secretsKey, storedKMSB),
		nodesApplied(b, forNode(added)),
		testbed.StatusProbe(b.shims(), clusterVerdictConverged),
		migrationVerifiedProbe(t, b, "kms-b"))
	if err != nil {
		t.Fatalf("converging on kms-b: %v", err)
	}
	migrated := time.Now()

	// Step 2: the guard allows the removal now.
	if out, err := runRekey(t, append([]string{"rotate", "--encryption-provider-config", src, "--remove-old", "kms-a"}, etcdFlags...)...); err != nil {
		t.Fatalf("--remove-old kms-a after the migration: %v\n%s", err, out)
	}
	removed, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(removed), "kms-a") || !strings.Contains(string(removed), "kms-b") {
		t.Fatalf("the file after --remove-old kms-a:\n%s", removed)
	}
	if _, err := b.syncer.ApplyEach(ctx, forNode(removed), nil).Wait(ctx); err != nil {
		t.Fatal(err)
	}
	actx, cancel := contextWithTimeout(t, 20*time.Second)
	defer cancel()
	if err := testbed.WaitFor(actx, 200*time.Millisecond, nodesApplied(b, forNode(removed))); err != nil {
		t.Fatalf("removing kms-a: %v", err)
	}
	done := time.Now()

	// Plugin A goes away on every node; everything still reads and writes.
	for _, p := range pluginsA {
		p.Stop(5 * time.Second)
	}
	time.Sleep(2 * time.Second) // two KMS status intervals, with writers and sampler running
	for _, s := range b.shims() {
		if err := s.Readyz(ctx); err != nil {
			t.Errorf("%s with plugin A stopped: %v", s.Name, err)
		}
	}
	for i, s := range b.fleet.Shims {
		if s.Current() != processes[i] || !s.Alive() {
			t.Errorf("%s was restarted or died during the rotation", s.ID)
		}
	}
	wr, sr := b.finish(l) // 0 failed writes, 0 bad reads, every Secret read through every shim
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, storedKMSB); err != nil {
		t.Error(err)
	}
	t.Logf("%d Secrets kms-a → kms-b: last file at +%v, migrated and verified %v after it, kms-a removed everywhere at +%v; "+
		"%d writes acknowledged, %d reads sampled; test %v",
		b.load.Objects(), last.Sub(edited).Round(time.Millisecond), migrated.Sub(last).Round(time.Millisecond),
		done.Sub(edited).Round(time.Millisecond), wr.Acked(), sr.Total().Reads, time.Since(start).Round(time.Millisecond))
}

// nodesApplied passes when every shim serves with its own node's copy of the file
// (the copies differ in their socket paths, so each has its own hash).
func nodesApplied(b *clusterBed, contentFor func(i int) []byte) testbed.Probe {
	want := map[string]string{}
	var shims []*testbed.Shim
	for i, s := range b.fleet.Shims {
		want[s.ID] = testbed.ConfigHash(contentFor(i))
		shims = append(shims, s.Current())
	}
	p := testbed.StatusProbe(shims, func(s *testbed.Shim, doc testbed.StatusDoc) error {
		if doc.ActiveConfigHash != want[s.Name] {
			return fmt.Errorf("serving %s, not %s yet (last error %q)", doc.ActiveConfigHash, want[s.Name], doc.LastError)
		}
		return nil
	})
	p.Name = "config applied"
	return p
}

// migrationVerifiedProbe asks `rekey status -o json` what an operator would: converged,
// every node a member, and the migration leader's record for secrets verified on target.
func migrationVerifiedProbe(t testing.TB, b *clusterBed, target string) testbed.Probe {
	return testbed.Probe{Name: "rekey status", Check: func(ctx context.Context) error {
		out, err := exec.CommandContext(ctx, rekeyBin(t), "status", "-o", "json",
			"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--coordination-prefix", b.coord).Output()
		var exit *exec.ExitError
		if err != nil && !errors.As(err, &exit) { // a non-zero exit is "not converged": the JSON says why
			return err
		}
		var st struct {
			cluster.Snapshot
			Verdict cluster.Verdict `json:"verdict"`
		}
		if err := json.Unmarshal(out, &st); err != nil {
			return fmt.Errorf("rekey status -o json: %w: %s", err, out)
		}
		switch {
		case !st.Verdict.Converged:
			return fmt.Errorf("verdict %q", st.Verdict.Summary)
		case len(st.Members) != len(b.fleet.Shims):
			return fmt.Errorf("%d members, want %d", len(st.Members), len(b.fleet.Shims))
		case st.Migration == nil:
			return errors.New("no migration state")
		}
		for res, r := range st.Migration.Records {
			if strings.HasPrefix(res, "secrets") && r.Target.Key == target && r.Verified {
				return nil
			}
		}
		return fmt.Errorf("no verified migration of secrets to %s in %v", target, st.Migration.Records)
	}}
}

// The provider switches of `rekey rotate` on a running apiserver, one rotate command each and no
// restart: identity → aesgcm (first-time encryption), then aesgcm → KMS v2. One shim
// (its own migrator) with writers and a sampler; after each switch the shim migrates,
// the guard lets the old provider go, and nothing fails or reads wrong.
func TestRotationSwitchesOnALiveShim(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	src := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, src, string(testbed.SecretsConfig(testbed.Identity()).Render()))
	const prefix = "/e2e-rotation-switches"
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: src, EtcdPrefix: prefix,
		Args: []string{"--storage-migration-check-interval", "250ms", "--kms-status-interval", "1s"}})
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	etcdFlags := []string{"--etcd-servers", etcd.Endpoint, "--etcd-prefix", prefix}
	secrets := prefix + "/secrets/"

	load := testbed.NewWorkload("switches", []testbed.Endpoint{&testbed.ShimEndpoint{Shim: s}})
	if err := load.Seed(ctx, "s", 150, 8); err != nil {
		t.Fatal(err)
	}
	if err := testbed.AllStoredUnder(ctx, cli, secrets, "plaintext"); err != nil {
		t.Fatal(err)
	}
	writers := load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50})
	sampler := load.StartSampler(ctx, testbed.SamplerConfig{Rate: 100})

	// switchTo runs rotate with flags, waits until every stored Secret carries
	// wantPrefix, removes old and waits until the shim serves the file without it.
	switchTo := func(wantPrefix, old string, flags ...string) {
		t.Helper()
		if out, err := runRekey(t, append([]string{"rotate", "--encryption-provider-config", src}, flags...)...); err != nil {
			t.Fatalf("rotate %v: %v\n%s", flags, err, out)
		}
		wctx, cancel := contextWithTimeout(t, 30*time.Second)
		defer cancel()
		err := testbed.WaitFor(wctx, 200*time.Millisecond, testbed.Probe{Name: "stored " + wantPrefix + "…", Check: func(ctx context.Context) error {
			got, err := testbed.StoredPrefixes(ctx, cli, secrets)
			if err != nil {
				return err
			}
			for p := range got {
				if !strings.HasPrefix(p, wantPrefix) {
					return fmt.Errorf("stored %v", got)
				}
			}
			return nil
		}})
		if err != nil {
			t.Fatal(err)
		}
		// The shim's migrator verifies after the last rewrite; the guard's inventory
		// then finds nothing on old (retried for the moment in between).
		eventually(t, 15*time.Second, 500*time.Millisecond, "--remove-old "+old, func() error {
			out, err := runRekey(t, append([]string{"rotate", "--encryption-provider-config", src, "--remove-old", old}, etcdFlags...)...)
			if err != nil {
				return fmt.Errorf("%w: %s", err, out)
			}
			return nil
		})
		content, err := os.ReadFile(src)
		if err != nil {
			t.Fatal(err)
		}
		actx, cancel := contextWithTimeout(t, 15*time.Second)
		defer cancel()
		if err := testbed.WaitFor(actx, 100*time.Millisecond, testbed.ConfigAppliedProbe([]*testbed.Shim{s}, content, nil)); err != nil {
			t.Fatal(err)
		}
	}
	switchTo("k8s:enc:aesgcm:v1:key-", "identity", "--provider", "aesgcm")
	data, err := os.ReadFile(src)
	if err != nil {
		t.Fatal(err)
	}
	key := regexp.MustCompile(`name: (key-\d{8}T\d{6}Z-[a-z2-7]{8})\b`).FindSubmatch(data)
	if key == nil {
		t.Fatalf("no generated key in the file:\n%s", data)
	}
	switchTo("k8s:enc:kms:v2:kms-1:", string(key[1]), "--provider", "kms", "--kms-name", "kms-1", "--kms-endpoint", plugin.Endpoint)

	time.Sleep(time.Second) // writers and sampler on the final file
	wr, sr := writers.Stop(), sampler.Stop()
	t.Logf("writers: %s\nsampler: %s", wr, sr)
	if wr.Failed() > 0 || wr.Acked() == 0 {
		t.Errorf("%d failed writes (%d acknowledged), e.g. %v", wr.Failed(), wr.Acked(), first(wr.Errors, 3))
	}
	if bad := sr.Total().Bad(); bad > 0 || sr.Total().Reads == 0 {
		t.Errorf("sampler: %d bad reads of %d, e.g. %v", bad, sr.Total().Reads, first(sr.Examples, 5))
	}
	rep, err := load.Verify(ctx, &testbed.ShimEndpoint{Shim: s})
	if err != nil || !rep.OK() || rep.Objects < load.Objects() {
		t.Errorf("verify: %v %v (%d acknowledged objects)", rep, err, load.Objects())
	}
	if err := testbed.AllStoredUnder(ctx, cli, secrets, "k8s:enc:kms:v2:kms-1:"); err != nil {
		t.Error(err)
	}
	select {
	case <-s.Done():
		t.Error("the shim exited during the switches")
	default:
	}
}
