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

// The rotation scenario's testbed, the same for both sides: a 3-member etcd, three
// shims running the side's layer, a source file a kubelet-like syncer copies to each
// shim, seeded Secrets under the old key, writers and a sampler.
const (
	// rotationPrefix is the shims' --etcd-prefix: rekey rotate's default.
	rotationPrefix = "/registry"
	// rotationTimeout bounds one side's rotation; upstream's needs about four minutes.
	rotationTimeout = 15 * time.Minute
)

// rotationBed is one side's fresh testbed.
type rotationBed struct {
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

// startRotationBed starts a fresh testbed in dir whose shims run layer side with
// shimFlags, seeds objects Secrets under a new key key1 and starts the writers and the
// sampler.
func startRotationBed(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, side string, objects int, shimFlags []string) (b *rotationBed, err error) {
	b = &rotationBed{}
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
		Layer: side, Config: b.initial, Args: shimFlags,
	})
	if err != nil {
		return nil, err
	}
	b.syncer, err = b.fleet.NewSyncer(testbed.SyncerConfig{MaxDelay: 10 * time.Second,
		Logf: func(format string, args ...any) {
			fmt.Fprintf(progress, "rotation: %s: "+format+"\n", append([]any{side}, args...)...)
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
	b.load = testbed.NewWorkload("rotation", b.fleet.Endpoints())
	seedStart := time.Now()
	if err := b.load.Seed(ctx, "s", objects, 8); err != nil {
		return nil, err
	}
	fmt.Fprintf(progress, "rotation: %s: %d Secrets under key1 in %v\n", side, objects, time.Since(seedStart).Round(time.Millisecond))
	b.clients = newClientLatencies()
	b.writers = b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50,
		Latency: b.clients.observer("writers")})
	b.sampler = b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200, Latency: b.clients.observer("sampler")})
	return b, nil
}

// stopLoad stops the writers and the sampler and returns what they saw.
func (b *rotationBed) stopLoad() (testbed.WriteReport, testbed.SampleReport) {
	return b.writers.Stop(), b.sampler.Stop()
}

func (b *rotationBed) stop() {
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

// rotationEnd is the end state of a rotation, checked independently of the procedure
// that claimed it.
type rotationEnd struct {
	newKey string
	// underNew of stored Secrets are under newKey (etcd scan).
	underNew, stored int
}

// checkEnd reads the end state: final (the source file's last content) must have
// dropped the old key, every stored Secret is counted by its key, and every write the
// writers had acknowledged must still be readable through every apiserver.
func (b *rotationBed) checkEnd(ctx context.Context, final []byte) (rotationEnd, error) {
	var end rotationEnd
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
