package e2e

// Key id hygiene (issue 29, item 2) with real processes: etcd, one shim, the local KMS v2
// plugin process and its fault modes, client-go. A key id flap rewrites nothing; a key
// id that comes back after another superseded it (A → B → A) is refused and raised.

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// keyIDDoc is the part of the shim's /rekey/status these tests read.
type keyIDDoc struct {
	KMSProviders []transformers.KMSStatus `json:"kmsProviders"`
	Cluster      struct {
		Conditions     []string `json:"conditions"`
		KMSKeyIDReuses []string `json:"kmsKeyIDReuses"`
	} `json:"cluster"`
}

func kmsStatusOf(ctx context.Context, s *testbed.Shim, provider string) (transformers.KMSStatus, keyIDDoc, error) {
	var d keyIDDoc
	doc, err := s.Status(ctx)
	if err != nil {
		return transformers.KMSStatus{}, d, err
	}
	if err := json.Unmarshal(doc.Raw, &d); err != nil {
		return transformers.KMSStatus{}, d, err
	}
	for _, k := range d.KMSProviders {
		if k.Name == provider {
			return k, d, nil
		}
	}
	return transformers.KMSStatus{}, d, fmt.Errorf("no KMS provider %q in the status document", provider)
}

// shimMetric sums the samples of the metric name on the shim's /metrics.
func shimMetric(ctx context.Context, hc *http.Client, s *testbed.Shim, name string) (float64, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/metrics", nil)
	if err != nil {
		return 0, err
	}
	resp, err := hc.Do(req)
	if err != nil {
		return 0, err
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, err
	}
	sum := 0.0
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name+"{") && !strings.HasPrefix(line, name+" ") {
			continue
		}
		f := strings.Fields(line)
		v, err := strconv.ParseFloat(f[len(f)-1], 64)
		if err != nil {
			return 0, fmt.Errorf("%s: %w", line, err)
		}
		sum += v
	}
	return sum, nil
}

// modRevisions maps every etcd key under prefix to its mod revision: a rewrite of an
// object changes its key's.
func modRevisions(t *testing.T, cli *clientv3.Client, prefix string) map[string]int64 {
	t.Helper()
	resp, err := cli.Get(t.Context(), prefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := make(map[string]int64, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		out[string(kv.Key)] = kv.ModRevision
	}
	return out
}

func rewritten(before, after map[string]int64) int {
	n := 0
	for k, rev := range before {
		if after[k] != rev {
			n++
		}
	}
	return n
}

// traffic reads the stored Secrets and writes Secrets of another namespace until
// stopped, counting the requests that failed.
type traffic struct {
	requests, failed atomic.Int64
	firstErr         atomic.Value
	stop             chan struct{}
	wg               sync.WaitGroup
}

func startTraffic(ctx context.Context, c *kubernetes.Clientset, ns, writeNS string, objects int) *traffic {
	tr := &traffic{stop: make(chan struct{})}
	tr.wg.Go(func() {
		for i := 0; ; i++ {
			select {
			case <-tr.stop:
				return
			default:
			}
			_, err := c.CoreV1().Secrets(ns).Get(ctx, fmt.Sprintf("s-%d", i%objects), metav1.GetOptions{})
			if err == nil {
				_, err = c.CoreV1().Secrets(writeNS).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("w-%d", i)},
					Data: map[string][]byte{"v": []byte("during")}}, metav1.CreateOptions{})
			}
			tr.requests.Add(2)
			if err != nil && ctx.Err() == nil {
				tr.failed.Add(1)
				tr.firstErr.CompareAndSwap(nil, err)
			}
			time.Sleep(20 * time.Millisecond)
		}
	})
	return tr
}

func (tr *traffic) end() (requests, failed int64, firstErr error) {
	close(tr.stop)
	tr.wg.Wait()
	err, _ := tr.firstErr.Load().(error)
	return tr.requests.Load(), tr.failed.Load(), err
}

// TestKMSKeyIDFlapsRewriteNothing: 500 Secrets under KMS v2, storage migration on. The
// plugin's key id flaps three ways for less than --kms-key-id-confirmations (2) Status
// answers: both Status and Encrypt move to another key (a key version flap), Status
// alone moves, and the plugin restarts with the start-up flap (its first Status reports
// a key URI). No stored Secret is rewritten, no DEK seed is made, no request fails, and
// /readyz stays up through the flaps without a restart.
func TestKMSKeyIDFlapsRewriteNothing(t *testing.T) {
	ctx := t.Context()
	start := time.Now()
	const objects = 500
	const provider = "flap"
	// A 2 s Status interval: a flap is cleared well within the one interval the second
	// confirmation waits; migration checks every 250 ms, so a key change would be
	// migrated at once.
	b := startKeyIDBed(t, provider, "/e2e-keyid-flap", "flap", objects, "2s")
	dir, sockDir, plugin, s, c, hc, cli, secretsKey := b.dir, b.sockDir, b.plugin, b.shim, b.client, b.hc, b.cli, b.secretsKey
	before := modRevisions(t, cli, secretsKey)
	if len(before) != objects {
		t.Fatalf("%d Secrets stored, want %d", len(before), objects)
	}
	metric := func(name string) float64 {
		t.Helper()
		v, err := shimMetric(ctx, hc, s, name)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	seeds := metric("rekey_kmsv2_dek_source_rotations_total")
	tr := startTraffic(ctx, c, "flap", "flap-writes", objects)
	var readyzDown atomic.Int64
	readyStop := make(chan struct{})
	var readyWG sync.WaitGroup
	readyWG.Go(func() {
		for {
			select {
			case <-readyStop:
				return
			case <-time.After(100 * time.Millisecond):
			}
			if err := s.Readyz(ctx); err != nil && ctx.Err() == nil {
				readyzDown.Add(1)
			}
		}
	})
	waitStatus := func(what string, check func(transformers.KMSStatus) error) {
		t.Helper()
		eventually(t, 30*time.Second, 50*time.Millisecond, what, func() error {
			k, _, err := kmsStatusOf(ctx, s, provider)
			if err != nil {
				return err
			}
			return check(k)
		})
	}
	candidate := func(keyID string) func(transformers.KMSStatus) error {
		return func(k transformers.KMSStatus) error {
			if k.CandidateKeyIDHash != state.KeyIDHash(keyID) {
				return fmt.Errorf("candidate %q, want %s", k.CandidateKeyIDHash, state.KeyIDHash(keyID))
			}
			return nil
		}
	}
	flaps := func(n float64) {
		t.Helper()
		eventually(t, 30*time.Second, 50*time.Millisecond, fmt.Sprintf("%v flaps counted", n), func() error {
			if got := metric("rekey_kmsv2_key_id_flaps_total"); got < n {
				return fmt.Errorf("rekey_kmsv2_key_id_flaps_total = %v", got)
			}
			return nil
		})
	}

	// 1. A key version flap: Status and Encrypt both move to kek-2, for one Status.
	if err := plugin.SetFaults(ctx, map[string]any{"activeKey": "kek-2"}); err != nil {
		t.Fatal(err)
	}
	waitStatus("kek-2 reported once", candidate("kek-2"))
	if err := plugin.SetFaults(ctx, nil); err != nil {
		t.Fatal(err)
	}
	flaps(1)

	// 2. Status alone moves.
	if err := plugin.SetFaults(ctx, map[string]any{"statusKeyID": "kek-x"}); err != nil {
		t.Fatal(err)
	}
	waitStatus("kek-x reported once", candidate("kek-x"))
	if err := plugin.SetFaults(ctx, nil); err != nil {
		t.Fatal(err)
	}
	flaps(2)
	readyStopOnce := sync.OnceFunc(func() { close(readyStop); readyWG.Wait() })
	defer readyStopOnce()
	readyStopOnce() // the restart below makes the plugin absent for a moment: not a flap's doing

	// 3. The plugin restarts with the start-up flap: its first Status reports the key
	// as a URI, every later answer the plain id.
	plugin.Stop(5 * time.Second)
	restarted, err := testbed.StartPluginArgs(ctx, bins.Plugin, dir, sockDir, []string{"--faults", `{"startupFlap":true}`})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { restarted.Stop(5 * time.Second) })
	flaps(3)
	waitStatus("healthy under kek-1 after the restart", func(k transformers.KMSStatus) error {
		if !k.Healthy || k.KeyIDHash != state.KeyIDHash("kek-1") || k.CandidateKeyIDHash != "" {
			return fmt.Errorf("%+v", k)
		}
		return nil
	})
	requests, failed, firstErr := tr.end()
	after := modRevisions(t, cli, secretsKey)
	n := rewritten(before, after)
	newSeeds := metric("rekey_kmsv2_dek_source_rotations_total") - seeds
	t.Logf("%d Secrets, 3 key id flaps (Status+Encrypt, Status alone, plugin start-up): %d rewritten, %v new DEK seeds, %d of %d requests failed, /readyz down %d times during flaps 1-2; %v",
		objects, n, newSeeds, failed, requests, readyzDown.Load(), time.Since(start).Round(time.Millisecond))
	if n != 0 {
		t.Errorf("%d stored Secrets were rewritten by key id flaps, want 0", n)
	}
	if newSeeds != 0 {
		t.Errorf("%v new DEK seeds during the flaps, want 0", newSeeds)
	}
	if failed != 0 {
		t.Errorf("%d requests failed during the flaps, want 0; first: %v", failed, firstErr)
	}
	if readyzDown.Load() != 0 {
		t.Errorf("/readyz failed %d times during the flaps without a restart, want 0", readyzDown.Load())
	}
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(cli, secretsKey, provider, "kek-1")); err != nil {
		t.Fatal(err)
	}
}

// TestKMSKeyIDReuseRefused: A → B → A. Secrets written under kek-1, the plugin rotates to
// kek-2 (the migration moves them), then reports kek-1 again. The reuse is refused: new
// writes stay under kek-2, nothing migrates back, the metric counts it, the status
// names it and the cluster raises the KMSKeyIDReuse condition; every Secret reads.
// Then the shim restarts into the reuse: the key ledger tells it kek-1 was superseded,
// so creates are refused with a 503 and reads go on.
func TestKMSKeyIDReuseRefused(t *testing.T) {
	ctx := t.Context()
	start := time.Now()
	const objects = 100
	const provider = "reuse"
	const prefix = "/e2e-keyid-reuse"
	b := startKeyIDBed(t, provider, prefix, "reuse", objects, "500ms")
	dir, config, plugin, s, c, hc, cli, secretsKey := b.dir, b.config, b.plugin, b.shim, b.client, b.hc, b.cli, b.secretsKey

	// A → B: a real rotation, migrated.
	if err := plugin.SetFaults(ctx, map[string]any{"activeKey": "kek-2"}); err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(ctx, 40*time.Second)
	defer cancel()
	if err := testbed.WaitFor(wctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(cli, secretsKey, provider, "kek-2")); err != nil {
		t.Fatal(err)
	}
	rotatedAt := time.Now()
	before := modRevisions(t, cli, secretsKey)
	// The key ledger learns kek-2 at once (the rotation wakes its recorder), and with it
	// that kek-1 was superseded.
	ledger := keyledger.Store{Client: cli, Key: keyledger.Key(coordinationPrefix(t))}
	eventually(t, 30*time.Second, 100*time.Millisecond, "kek-1 superseded in the key ledger", func() error {
		l, _, _, err := ledger.Load(ctx)
		if err != nil {
			return err
		}
		if got := l.SupersededKMSKeyIDs()[provider]; len(got) != 1 || got[0] != state.KeyIDHash("kek-1") {
			return fmt.Errorf("superseded key ids of %s: %v", provider, got)
		}
		return nil
	})

	// B → A: the reuse.
	if err := plugin.SetFaults(ctx, map[string]any{"activeKey": "kek-1"}); err != nil {
		t.Fatal(err)
	}
	var doc keyIDDoc
	eventually(t, 30*time.Second, 50*time.Millisecond, "the reuse raised in status and metrics", func() error {
		k, d, err := kmsStatusOf(ctx, s, provider)
		if err != nil {
			return err
		}
		doc = d
		if k.ReusedKeyIDHash != state.KeyIDHash("kek-1") || k.KeyIDHash != state.KeyIDHash("kek-2") || !k.Healthy {
			return fmt.Errorf("status %+v", k)
		}
		if v, err := shimMetric(ctx, hc, s, "rekey_kmsv2_key_id_reuses_total"); err != nil || v != 1 {
			return fmt.Errorf("rekey_kmsv2_key_id_reuses_total = %v (%v)", v, err)
		}
		if v, err := shimMetric(ctx, hc, s, "rekey_kmsv2_key_id_reused"); err != nil || v != 1 {
			return fmt.Errorf("rekey_kmsv2_key_id_reused = %v (%v)", v, err)
		}
		return nil
	})
	raisedAfter := time.Since(rotatedAt)
	eventually(t, 30*time.Second, 100*time.Millisecond, "the cluster's KMSKeyIDReuse condition", func() error {
		_, d, err := kmsStatusOf(ctx, s, provider)
		if err != nil {
			return err
		}
		doc = d
		for _, cond := range d.Cluster.Conditions {
			if cond == cluster.ConditionKMSKeyIDReuse {
				return nil
			}
		}
		return fmt.Errorf("conditions %v", d.Cluster.Conditions)
	})
	// The plugin answers several more Statuses with kek-1: still refused, nothing moves.
	statusesBefore := pluginStatusCalls(t, plugin)
	eventually(t, 30*time.Second, 50*time.Millisecond, "four more Statuses", func() error {
		if n := pluginStatusCalls(t, plugin); n < statusesBefore+4 {
			return fmt.Errorf("%d Status calls since", n-statusesBefore)
		}
		return nil
	})
	if _, err := c.CoreV1().Secrets("reuse").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "during-reuse"},
		Data: map[string][]byte{"v": []byte("x")}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("a write during the refused reuse: %v", err)
	}
	after := modRevisions(t, cli, secretsKey)
	delete(after, secretsKey+"during-reuse")
	if n := rewritten(before, after); n != 0 {
		t.Errorf("%d Secrets rewritten after the plugin went back to kek-1, want 0 (a reuse is never migrated into)", n)
	}
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(cli, secretsKey, provider, "kek-2")); err != nil {
		t.Fatalf("stored under another key id than kek-2: %v", err)
	}
	list, err := c.CoreV1().Secrets("reuse").List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) != objects+1 {
		t.Fatalf("listing the Secrets during the reuse: %d items, %v", len(list.Items), err)
	}
	if err := s.Readyz(ctx); err != nil {
		t.Errorf("/readyz during the refused reuse: %v", err)
	}
	t.Logf("A→B→A with %d Secrets: the reuse raised %v after the rotation to B had migrated; 0 rewritten back; cluster: %v; %v",
		objects, raisedAfter.Round(time.Millisecond), doc.Cluster.KMSKeyIDReuses, time.Since(start).Round(time.Millisecond))

	// Back to B: the reuse clears.
	if err := plugin.SetFaults(ctx, map[string]any{"activeKey": "kek-2"}); err != nil {
		t.Fatal(err)
	}
	eventually(t, 30*time.Second, 50*time.Millisecond, "the reuse cleared", func() error {
		k, _, err := kmsStatusOf(ctx, s, provider)
		if err != nil {
			return err
		}
		if k.ReusedKeyIDHash != "" {
			return fmt.Errorf("still reused: %+v", k)
		}
		return nil
	})

	// A restart while the plugin reports kek-1: the new process never wrote with
	// kek-2, but the key ledger says kek-1 was superseded. No seed is taken: creates
	// are refused with a 503 naming the reuse, every Secret reads, /readyz is up.
	if err := plugin.SetFaults(ctx, map[string]any{"activeKey": "kek-1"}); err != nil {
		t.Fatal(err)
	}
	s.Stop(15 * time.Second)
	s = startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdPrefix: prefix,
		Args: []string{"--kms-status-interval", "500ms", "--kms-retry-interval", "250ms", "--storage-migration-check-interval", "250ms"}})
	c = clientFor(t, s)
	eventually(t, 30*time.Second, 50*time.Millisecond, "the reuse refused at start", func() error {
		k, _, err := kmsStatusOf(ctx, s, provider)
		if err != nil {
			return err
		}
		if k.ReusedKeyIDHash != state.KeyIDHash("kek-1") || k.KeyIDHash != "" {
			return fmt.Errorf("status %+v", k)
		}
		return nil
	})
	_, createErr := c.CoreV1().Secrets("reuse").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "after-restart"},
		Data: map[string][]byte{"v": []byte("x")}}, metav1.CreateOptions{})
	if !apierrors.IsServiceUnavailable(createErr) || !strings.Contains(createErr.Error(), "reuse") {
		t.Fatalf("a create after the restart into the reuse: %v; want 503 naming the reuse", createErr)
	}
	list, err = c.CoreV1().Secrets("reuse").List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) != objects+1 {
		t.Fatalf("listing the Secrets after the restart: %d items, %v", len(list.Items), err)
	}
	if err := s.Readyz(ctx); err != nil {
		t.Errorf("/readyz after the restart into the reuse: %v", err)
	}
	if n := rewritten(before, modRevisions(t, cli, secretsKey)); n != 0 {
		t.Errorf("%d Secrets rewritten, want 0", n)
	}
	t.Logf("restart into the reuse: create refused: %v", createErr)
}

// pluginStatusCalls is how many Status calls the plugin process has answered.
func pluginStatusCalls(t *testing.T, p *testbed.Plugin) int64 {
	t.Helper()
	resp, err := http.Get(p.ControlURL + "/stats")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st kmsplugin.Stats
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st.Status
}

// keyIDBed is the set-up of the key id tests: a plugin with kek-1 (active) and kek-2,
// a shim encrypting Secrets with it (provider name given; identity for the rest), and
// objects Secrets of namespace ns stored under kek-1.
type keyIDBed struct {
	dir, sockDir, config, secretsKey string
	plugin                           *testbed.Plugin
	shim                             *testbed.Shim
	client                           *kubernetes.Clientset
	hc                               *http.Client
	cli                              *clientv3.Client
}

// startKeyIDBed starts it with the shim's --kms-status-interval statusInterval
// (retries and migration checks every 250 ms, so that a key change would act at once).
func startKeyIDBed(t *testing.T, provider, prefix, ns string, objects int, statusInterval string) *keyIDBed {
	t.Helper()
	ctx := t.Context()
	b := &keyIDBed{dir: t.TempDir(), sockDir: shortTempDir(t), secretsKey: prefix + "/secrets/" + ns + "/"}
	kek1, kek2 := testbed.PluginKey{Name: "kek-1", Secret: testbed.RandomKey()}, testbed.PluginKey{Name: "kek-2", Secret: testbed.RandomKey()}
	var err error
	if b.plugin, err = testbed.StartPlugin(ctx, bins.Plugin, b.dir, b.sockDir, kek1, kek2); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.plugin.Stop(5 * time.Second) })
	b.config = filepath.Join(b.dir, "encryption.yaml")
	writeConfig(t, b.config, encryptionConfig([]string{kms(provider, b.plugin.Endpoint)}, []string{identity}))
	b.shim = startShim(t, testbed.ShimConfig{Dir: b.dir, EncryptionConfig: b.config, EtcdPrefix: prefix,
		Args: []string{"--kms-status-interval", statusInterval, "--kms-retry-interval", "250ms", "--storage-migration-check-interval", "250ms"}})
	b.client = clientFor(t, b.shim)
	if b.hc, err = b.shim.HTTPClient(true); err != nil {
		t.Fatal(err)
	}
	if b.cli, err = testbed.EtcdClient([]string{etcd.Endpoint}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.cli.Close() })
	createObjects(t, b.client, ns, objects)
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, provider, "kek-1")); err != nil {
		t.Fatal(err)
	}
	return b
}
