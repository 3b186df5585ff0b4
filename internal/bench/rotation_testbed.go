package bench

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The rotation scenario's testbed, the same for both sides: a 3-member etcd, three
// shims running the side's layer, a source file a kubelet-like syncer copies to each
// shim, seeded Secrets under the old key, writers and a sampler.
const (
	// lastConfigInfo is the metric both layers expose with the hash of the config they
	// serve: "sha256:" and the hex SHA-256 of the file's bytes (k8s.io/apiserver's
	// encryptionconfig computeEncryptionConfigHash, and pkg/config.Hash). Its name is
	// BuildFQName("apiserver", "encryption_config_controller", "last_config_info") in
	// k8s.io/apiserver's encryptionconfig/metrics: there is no "automatic_reload" in it.
	lastConfigInfo = "apiserver_encryption_config_controller_last_config_info"
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
}

// startRotationBed starts a fresh testbed in dir whose shims run layer side, seeds
// objects Secrets under a new key key1 and starts the writers and the sampler.
func startRotationBed(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, side string, objects int) (b *rotationBed, err error) {
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
		Layer: side, Config: b.initial,
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
	b.writers = b.load.StartWriters(ctx, testbed.WritersConfig{PerEndpoint: 2, Pause: 20 * time.Millisecond, CreateEvery: 50})
	b.sampler = b.load.StartSampler(ctx, testbed.SamplerConfig{Rate: 200})
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

// waitConfigHash polls every shim's /metrics until its last_config_info metric shows
// the hash of content, and returns when the last one did.
func waitConfigHash(ctx context.Context, fleet *testbed.Fleet, content []byte, timeout time.Duration) (time.Time, error) {
	want := testbed.ConfigHash(content)
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	shims := fleet.Running()
	clients := make([]*http.Client, len(shims))
	for i, s := range shims {
		c, err := s.HTTPClient(true)
		if err != nil {
			return time.Time{}, err
		}
		defer c.CloseIdleConnections()
		clients[i] = c
	}
	pending := map[int]string{}
	for i := range shims {
		pending[i] = "not asked yet"
	}
	for {
		for i := range pending {
			got, err := configHashes(ctx, clients[i], shims[i].URL)
			switch {
			case err != nil:
				pending[i] = err.Error()
			case len(got) > 0 && !slices.ContainsFunc(got, func(h string) bool { return h != want }):
				delete(pending, i)
			default:
				pending[i] = fmt.Sprintf("reports %v", got)
			}
		}
		if len(pending) == 0 {
			return time.Now(), nil
		}
		select {
		case <-ctx.Done():
			var why []string
			for i, p := range pending {
				why = append(why, shims[i].Name+": "+p)
			}
			slices.Sort(why)
			return time.Time{}, fmt.Errorf("waiting for every apiserver's %s to show %s: %w (%s)", lastConfigInfo, want, ctx.Err(), strings.Join(why, "; "))
		case <-time.After(500 * time.Millisecond):
		}
	}
}

// configHashes returns the hash labels of the last_config_info samples of one
// apiserver's /metrics.
func configHashes(ctx context.Context, c *http.Client, url string) ([]string, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, url+"/metrics", nil)
	if err != nil {
		return nil, err
	}
	resp, err := c.Do(req)
	if err != nil {
		return nil, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return nil, fmt.Errorf("/metrics: %s", resp.Status)
	}
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return nil, err
	}
	return parseConfigHashes(body), nil
}

// parseConfigHashes picks the hash label out of every last_config_info sample of a
// Prometheus text exposition.
func parseConfigHashes(body []byte) []string {
	var out []string
	for _, line := range bytes.Split(body, []byte("\n")) {
		rest, ok := bytes.CutPrefix(line, []byte(lastConfigInfo+"{"))
		if !ok {
			continue
		}
		_, after, ok := bytes.Cut(rest, []byte(`hash="`))
		// apiserver_id_hash="..." also ends in hash=": only a label that starts the
		// label set or follows a comma is the config hash.
		for ok {
			start := len(rest) - len(after) - len(`hash="`)
			if start == 0 || rest[start-1] == ',' {
				break
			}
			_, after, ok = bytes.Cut(after, []byte(`hash="`))
		}
		if !ok {
			continue
		}
		if v, _, ok := bytes.Cut(after, []byte(`"`)); ok {
			out = append(out, string(v))
		}
	}
	return out
}
