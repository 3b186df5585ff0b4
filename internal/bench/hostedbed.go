package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The testbed of the rotation and controller scenarios, the same for both sides of
// each: a 3-member etcd, three shims running the side's layer, a kubelet-like syncer
// that copies a source (a file, a Secret) to each shim's file, seeded Secrets under the
// old key, writers and a sampler; what one side of a rotation measured; the rekey
// binary they run.
const (
	// rotationPrefix is the shims' --etcd-prefix: rekey rotate's default.
	rotationPrefix = "/registry"
	// rotationTimeout bounds one side's rotation; upstream's needs about four minutes.
	rotationTimeout = 15 * time.Minute
)

// hostedBed is one side's fresh testbed.
type hostedBed struct {
	etcd   *testbed.EtcdCluster
	cli    *clientv3.Client
	fleet  *testbed.Fleet
	syncer *testbed.FileSyncer
	load   *testbed.Workload
	// sourcePath is the operator's source file, initially initial: every Secret under
	// oldKey.
	sourcePath string
	initial    []byte
	oldKey     testbed.NamedKey
	writers    *testbed.Writers
	sampler    *testbed.Sampler
	// clients times the writers' and the sampler's requests.
	clients *clientLatencies
}

// hostedBedConfig is what differs between the testbeds of the rotation and the
// controller scenarios and between their sides.
type hostedBedConfig struct {
	// scenario and side start every progress line ("rotation: rekey: ...").
	scenario, side string
	// layer is the shims' --encryption-layer (rekey, upstream).
	layer   string
	objects int
	// shimFlags are more flags for every shim.
	shimFlags []string
	// minDelay and maxDelay bound each shim's file update delay (default 0–10 s);
	// seed seeds them (0: from the clock; logged either way).
	minDelay, maxDelay time.Duration
	seed               uint64
}

// startHostedBed starts a fresh testbed in dir as c says, seeds c.objects Secrets under a
// new key key1 and starts the writers and the sampler.
func startHostedBed(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, c hostedBedConfig) (b *hostedBed, err error) {
	side, objects := c.side, c.objects
	if c.maxDelay == 0 && c.minDelay == 0 {
		c.maxDelay = 10 * time.Second
	}
	b = &hostedBed{}
	defer func() {
		if err != nil {
			b.stop()
		}
	}()
	if b.etcd, err = testbed.StartEtcdCluster(ctx, bins.Etcd, filepath.Join(dir, "etcd"), 3); err != nil {
		return nil, err
	}
	if b.cli, err = b.etcd.Client(); err != nil {
		return nil, err
	}
	b.oldKey = testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()}
	b.initial = testbed.SecretsConfig(testbed.AESGCM(b.oldKey)).Render()
	b.fleet, err = testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: bins.Shim, Dir: filepath.Join(dir, "shims"), N: 3,
		EtcdServers: b.etcd.Endpoints(), EtcdPrefix: rotationPrefix,
		Layer: c.layer, Config: b.initial, Args: c.shimFlags,
	})
	if err != nil {
		return nil, err
	}
	b.syncer, err = b.fleet.NewSyncer(testbed.SyncerConfig{MinDelay: c.minDelay, MaxDelay: c.maxDelay, Seed: c.seed,
		Logf: func(format string, args ...any) {
			fmt.Fprintf(progress, "%s: %s: "+format+"\n", append([]any{c.scenario, side}, args...)...)
		}})
	if err != nil {
		return nil, err
	}
	b.sourcePath = filepath.Join(dir, "source", "encryption.yaml")
	if err := os.MkdirAll(filepath.Dir(b.sourcePath), 0o700); err != nil {
		return nil, err
	}
	if err := os.WriteFile(b.sourcePath, b.initial, 0o600); err != nil {
		return nil, err
	}
	b.load = testbed.NewWorkload(c.scenario, b.fleet.Endpoints())
	seedStart := time.Now()
	if err := b.load.Seed(ctx, "s", objects, 8); err != nil {
		return nil, err
	}
	fmt.Fprintf(progress, "%s: %s: %d Secrets under key1 in %v\n", c.scenario, side, objects, time.Since(seedStart).Round(time.Millisecond))
	b.clients = newClientLatencies()
	b.writers = b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50,
		Latency: b.clients.observer("writers")})
	b.sampler = b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200, Latency: b.clients.observer("sampler")})
	return b, nil
}

// stopLoad stops the writers and the sampler and returns what they saw.
func (b *hostedBed) stopLoad() (testbed.WriteReport, testbed.SampleReport) {
	return b.writers.Stop(), b.sampler.Stop()
}

func (b *hostedBed) stop() {
	if b.cli != nil {
		b.cli.Close()
	}
	if b.fleet != nil {
		b.fleet.Stop()
	}
	if b.etcd != nil {
		b.etcd.Stop()
	}
}

// hostedEnd is the end state of a rotation, checked independently of the procedure
// that claimed it.
type hostedEnd struct {
	newKey string
	// underNew of stored Secrets are under newKey (etcd scan).
	underNew, stored int
}

// checkEnd reads the end state: final (the source file's last content) must have
// dropped the old key, every stored Secret is counted by its key, and every write the
// writers had acknowledged must still be readable through every apiserver.
func (b *hostedBed) checkEnd(ctx context.Context, final []byte) (hostedEnd, error) {
	var end hostedEnd
	keys, err := testbed.AESGCMKeyNames(final)
	if err != nil {
		return end, err
	}
	if slices.Contains(keys, b.oldKey.Name) || len(keys) == 0 {
		return end, fmt.Errorf("the final source config still has %v: the old key was not removed", keys)
	}
	end.newKey = keys[0]
	stored, err := testbed.StoredPrefixes(ctx, b.cli, rotationPrefix+"/secrets/")
	if err != nil {
		return end, err
	}
	want := "k8s:enc:aesgcm:v1:" + end.newKey + ":"
	for p, n := range stored {
		end.stored += n
		if p == want {
			end.underNew += n
		}
	}
	for _, ep := range b.fleet.Endpoints() {
		rep, err := b.load.Verify(ctx, ep)
		if err != nil {
			return end, err
		}
		if !rep.OK() {
			return end, fmt.Errorf("lost or overwritten writes after the rotation: %s", rep)
		}
	}
	return end, nil
}

// rotationResult is what one side of a rotation measured (the rotation scenario's
// result; the controller scenario's embeds it).
type rotationResult struct {
	side string
	// total is from the first edit of the source file to "old key removed everywhere";
	// afterLastFile is from the last per-apiserver file update of the first edit.
	total, afterLastFile time.Duration
	edits                int
	writes               testbed.WriteReport
	reads                testbed.SampleReport
	// underNew of stored Secrets are under the new key at the end (etcd scan).
	underNew, stored int
	newKey           string
	// rewritten and rewriteConflicts are the upstream script's no-op updates.
	rewritten, rewriteConflicts int64
	// rewriteTime is how long the stored Secrets took to rewrite: rekey's migrate stage
	// (as rotate reports its stages), upstream's replace of every Secret.
	rewriteTime time.Duration
	// clients are the writers' and the sampler's latencies before and during the
	// rotation.
	clients []latencySummary
}
