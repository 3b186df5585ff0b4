package e2e

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
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

	"github.com/rekey-io/rekey/internal/testbed"
)

// storageDoc is the part of the status document the migration tests read: the agent's
// members and the shim's "storage" section.
type storageDoc struct {
	ActiveConfigHash string `json:"activeConfigHash"`
	ReloadsSucceeded int64  `json:"reloadsSucceeded"`
	ReloadsFailed    int64  `json:"reloadsFailed"`
	LastError        string `json:"lastError"`
	Storage          *struct {
		AutoMigrate   bool     `json:"autoMigrate"`
		Running       []string `json:"running"`
		LastError     string   `json:"lastError"`
		LastMigration *struct {
			Resources []string `json:"resources"`
			Error     string   `json:"error"`
			Counters  struct {
				Rewritten int64 `json:"rewritten"`
				Conflicts int64 `json:"conflicts"`
			} `json:"counters"`
		} `json:"lastMigration"`
		Inventory *struct {
			Resources []struct {
				Resource    string `json:"resource"`
				WritePrefix string `json:"writePrefix"`
				Objects     int64  `json:"objects"`
				Stale       int64  `json:"stale"`
				Unreadable  int64  `json:"unreadable"`
			} `json:"resources"`
		} `json:"inventory"`
	} `json:"storage"`
}

func getStorageDoc(t *testing.T, s *testbed.Shim) (storageDoc, string) {
	t.Helper()
	return statusDoc[storageDoc](t, s)
}

// settled checks that the latest inventory shows resource written with
// writePrefix and nothing stale or unreadable.
func (d storageDoc) settled(resource, writePrefix string) error {
	if d.Storage == nil || d.Storage.Inventory == nil {
		return fmt.Errorf("no inventory yet")
	}
	if len(d.Storage.Running) > 0 {
		return fmt.Errorf("migration of %v running", d.Storage.Running)
	}
	for _, r := range d.Storage.Inventory.Resources {
		if r.Resource != resource {
			continue
		}
		if r.WritePrefix != writePrefix || r.Stale != 0 || r.Unreadable != 0 {
			return fmt.Errorf("%s: write prefix %q, %d objects, %d stale, %d unreadable", resource, r.WritePrefix, r.Objects, r.Stale, r.Unreadable)
		}
		return nil
	}
	return fmt.Errorf("%s not in the inventory", resource)
}

// ownedWriters update objects they own (read, change, update; a conflict re-reads and
// retries) and create new ones, remembering the last value each successful write left,
// so the test can prove no update was lost to a migration's rewrite.
type ownedWriters struct {
	stop      chan struct{}
	wg        sync.WaitGroup
	mu        sync.Mutex
	last      map[string]string // "secrets/<name>" or "configmaps/<name>" → value
	updates   atomic.Int64
	conflicts atomic.Int64
	failures  atomic.Int64
	errs      []string
}

func startOwnedWriters(t *testing.T, c *kubernetes.Clientset, ns string, n int, owned [][]string, last map[string]string) *ownedWriters {
	w := &ownedWriters{stop: make(chan struct{}), last: last}
	for g := range n {
		w.wg.Go(func() {
			rng := rand.New(rand.NewPCG(uint64(g), 7))
			for iter := 0; ; iter++ {
				select {
				case <-w.stop:
					return
				default:
				}
				val := fmt.Sprintf("w%d-%d", g, iter)
				var obj string
				var err error
				if iter%10 == 9 { // every tenth step creates an object
					obj, err = w.create(t.Context(), c, ns, fmt.Sprintf("new-%d-%d", g, iter), val, iter%20 == 9)
				} else {
					obj = owned[g][rng.IntN(len(owned[g]))]
					err = w.update(t.Context(), c, ns, obj, val)
				}
				if err != nil {
					w.failures.Add(1)
					w.mu.Lock()
					w.errs = append(w.errs, err.Error())
					w.mu.Unlock()
					continue
				}
				w.updates.Add(1)
				w.mu.Lock()
				w.last[obj] = val
				w.mu.Unlock()
			}
		})
	}
	return w
}

func (w *ownedWriters) create(ctx context.Context, c *kubernetes.Clientset, ns, name, val string, secret bool) (string, error) {
	if secret {
		_, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
			Data: map[string][]byte{"v": []byte(val)}}, metav1.CreateOptions{})
		return "secrets/" + name, err
	}
	_, err := c.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name},
		Data: map[string]string{"v": val}}, metav1.CreateOptions{})
	return "configmaps/" + name, err
}

// update sets the object's value to val, re-reading after each conflict.
func (w *ownedWriters) update(ctx context.Context, c *kubernetes.Clientset, ns, obj, val string) error {
	kind, name, _ := strings.Cut(obj, "/")
	for attempt := 0; attempt < 20; attempt++ {
		var err error
		if kind == "secrets" {
			var s *corev1.Secret
			if s, err = c.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
				return err
			}
			s.Data["v"] = []byte(val)
			_, err = c.CoreV1().Secrets(ns).Update(ctx, s, metav1.UpdateOptions{})
		} else {
			var cm *corev1.ConfigMap
			if cm, err = c.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
				return err
			}
			cm.Data["v"] = val
			_, err = c.CoreV1().ConfigMaps(ns).Update(ctx, cm, metav1.UpdateOptions{})
		}
		if apierrors.IsConflict(err) {
			w.conflicts.Add(1)
			continue
		}
		return err
	}
	return fmt.Errorf("%s: 20 conflicts in a row", obj)
}

func (w *ownedWriters) finish() {
	close(w.stop)
	w.wg.Wait()
}

// createObjects creates n Secrets and n ConfigMaps with value "init" in parallel and
// returns their names ("secrets/s-0", ...).
func createObjects(t *testing.T, c *kubernetes.Clientset, ns string, n int) []string {
	t.Helper()
	names := make([]string, 0, 2*n)
	for i := range n {
		names = append(names, fmt.Sprintf("secrets/s-%d", i), fmt.Sprintf("configmaps/c-%d", i))
	}
	var next atomic.Int64
	var failed atomic.Value
	var wg sync.WaitGroup
	for range 8 {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(names) {
					return
				}
				kind, name, _ := strings.Cut(names[i], "/")
				var err error
				if kind == "secrets" {
					_, err = c.CoreV1().Secrets(ns).Create(t.Context(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
						Data: map[string][]byte{"v": []byte("init")}}, metav1.CreateOptions{})
				} else {
					_, err = c.CoreV1().ConfigMaps(ns).Create(t.Context(), &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name},
						Data: map[string]string{"v": "init"}}, metav1.CreateOptions{})
				}
				if err != nil {
					failed.Store(err)
				}
			}
		})
	}
	wg.Wait()
	if err, _ := failed.Load().(error); err != nil {
		t.Fatal(err)
	}
	return names
}

// rawPrefixes counts the stored values under key prefix per encryption prefix (up to
// the key name or KMS provider name).
func rawPrefixes(t *testing.T, ctx context.Context, keyPrefix string) map[string]int {
	t.Helper()
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(ctx, keyPrefix, clientv3.WithPrefix())
	if err != nil {
		t.Fatal(err)
	}
	out := map[string]int{}
	for _, kv := range resp.Kvs {
		v := kv.Value
		p := "plaintext"
		if bytes.HasPrefix(v, []byte("k8s:enc:")) {
			parts := bytes.SplitN(v, []byte(":"), 6) // k8s enc <provider> <version> <key> rest
			p = string(bytes.Join(parts[:5], []byte(":"))) + ":"
		}
		out[p]++
	}
	return out
}

func e2eLong() bool { return os.Getenv("E2E_LONG") == "1" }

// The shim migrates on its own: objects created under key1, concurrent writers
// throughout, a new aesgcm key put first, then configmaps switched to KMS v2. The
// status document ends with nothing stale or unreadable, every stored value carries
// the new prefix, every object reads back with the last value its writer wrote (no
// update lost to a rewrite), and dropping the old key is then applied by the guard.
func TestShimMigratesAfterWriteKeyChange(t *testing.T) {
	ctx := t.Context()
	n := 200
	if e2eLong() {
		n = 3000
	}
	start := time.Now()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	config := filepath.Join(dir, "encryption.yaml")
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	const prefix = "/e2e-migrate"
	const k1, k2 = "k8s:enc:aesgcm:v1:key1:", "k8s:enc:aesgcm:v1:key2:"
	kmsPrefix := "k8s:enc:kms:v2:e2e-migrate:"
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", key1)}, []string{aesgcm("key1", key1)}))
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdPrefix: prefix,
		Args: []string{"--storage-migration-check-interval", "250ms", "--kms-status-interval", "1s"}})
	c := clientFor(t, s)
	ns := "migrate"

	names := createObjects(t, c, ns, n)
	// The resources the test writes (the apiserver stores its EncryptionState beside them).
	for _, r := range []string{"/secrets/", "/configmaps/"} {
		if got := rawPrefixes(t, ctx, prefix+r); got[k1] != n || len(got) != 1 {
			t.Fatalf("before rotation, stored under %s: %v", r, got)
		}
	}
	created := time.Now()

	last := map[string]string{}
	for _, name := range names {
		last[name] = "init"
	}
	const writers = 4
	owned := make([][]string, writers)
	for i, name := range names[:min(len(names), 400)] { // a hot set keeps the conflicts coming
		owned[i%writers] = append(owned[i%writers], name)
	}
	w := startOwnedWriters(t, c, ns, writers, owned, last)
	time.Sleep(500 * time.Millisecond)

	// Step 1: key2 first, key1 second, for both resources. The migration's pace is the
	// clients' (they are slower on a machine running other test groups, and so is the
	// migration): the budgets below bound a stall, not the speed, which the benchmarks
	// measure.
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key2", key2), aesgcm("key1", key1)}, []string{aesgcm("key2", key2), aesgcm("key1", key1)}))
	eventually(t, 120*time.Second, 100*time.Millisecond, "migration to key2", func() error {
		d, _ := getStorageDoc(t, s)
		if err := d.settled("secrets", k2); err != nil {
			return err
		}
		return d.settled("configmaps", k2)
	})
	rotated := time.Now()
	d, _ := getStorageDoc(t, s)
	if m := d.Storage.LastMigration; m == nil || m.Error != "" || m.Counters.Rewritten == 0 {
		t.Fatalf("last migration after the aesgcm rotation: %+v", m)
	}

	// Step 2: configmaps move to KMS v2, key2 and key1 stay readable.
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key2", key2), aesgcm("key1", key1)},
		[]string{kms("e2e-migrate", plugin.Endpoint), aesgcm("key2", key2), aesgcm("key1", key1)}))
	eventually(t, 120*time.Second, 100*time.Millisecond, "migration of configmaps to KMS v2", func() error {
		d, _ := getStorageDoc(t, s)
		if err := d.settled("configmaps", kmsPrefix); err != nil {
			return err
		}
		return d.settled("secrets", k2)
	})
	toKMS := time.Now()
	time.Sleep(300 * time.Millisecond) // writers keep going on the final keys
	w.finish()
	t.Logf("%d objects; writers: %d writes, %d conflicts retried, %d failures", len(names), w.updates.Load(), w.conflicts.Load(), w.failures.Load())
	if w.failures.Load() > 0 {
		t.Errorf("%d failed writes, e.g. %s", w.failures.Load(), w.errs[0])
	}
	if w.updates.Load() < 20 {
		t.Errorf("the writers made little progress: %d writes", w.updates.Load())
	}

	// Every stored value carries the new prefix, and nothing else is there.
	secretsRaw, cmRaw := rawPrefixes(t, ctx, prefix+"/secrets/"), rawPrefixes(t, ctx, prefix+"/configmaps/")
	var wantSecrets, wantCMs int
	for name := range w.last {
		if strings.HasPrefix(name, "secrets/") {
			wantSecrets++
		} else {
			wantCMs++
		}
	}
	if len(secretsRaw) != 1 || secretsRaw[k2] != wantSecrets {
		t.Errorf("stored secrets: %v, want %d under %s", secretsRaw, wantSecrets, k2)
	}
	if len(cmRaw) != 1 || cmRaw[kmsPrefix] != wantCMs {
		t.Errorf("stored configmaps: %v, want %d under %s", cmRaw, wantCMs, kmsPrefix)
	}

	// Every object reads back through the shim with its writer's last value.
	got := map[string]string{}
	sl, err := c.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range sl.Items {
		got["secrets/"+o.Name] = string(o.Data["v"])
	}
	cl, err := c.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{})
	if err != nil {
		t.Fatal(err)
	}
	for _, o := range cl.Items {
		got["configmaps/"+o.Name] = o.Data["v"]
	}
	lost := 0
	for name, want := range w.last {
		if got[name] != want {
			if lost < 5 {
				t.Errorf("%s: read %q, the last successful write was %q", name, got[name], want)
			}
			lost++
		}
	}
	if lost > 0 || len(got) != len(w.last) {
		t.Fatalf("%d of %d objects differ from their last write; %d listed", lost, len(w.last), len(got))
	}

	// Step 3: key1 is no longer used anywhere; dropping it is applied.
	before, _ := getStorageDoc(t, s)
	final := encryptionConfig([]string{aesgcm("key2", key2)}, []string{kms("e2e-migrate", plugin.Endpoint), aesgcm("key2", key2)})
	writeConfig(t, config, final)
	eventually(t, 20*time.Second, 100*time.Millisecond, "config without key1 applied", func() error {
		d, body := getStorageDoc(t, s)
		if d.ReloadsFailed != before.ReloadsFailed {
			return fmt.Errorf("refused: %s", d.LastError)
		}
		// No rule reads key1 any more (the key's write count and ledger entry stay).
		var rules struct {
			Resources []struct {
				ReadPrefixes []string `json:"readPrefixes"`
			} `json:"resources"`
		}
		if err := json.Unmarshal([]byte(body), &rules); err != nil || len(rules.Resources) == 0 {
			return fmt.Errorf("status document without rules: %v", err)
		}
		for _, r := range rules.Resources {
			if d.ReloadsSucceeded <= before.ReloadsSucceeded || slices.Contains(r.ReadPrefixes, "k8s:enc:aesgcm:v1:key1:") {
				return fmt.Errorf("not applied yet (%d reloads)", d.ReloadsSucceeded)
			}
		}
		return nil
	})
	if _, err := c.CoreV1().Secrets(ns).Get(ctx, "s-0", metav1.GetOptions{}); err != nil {
		t.Fatalf("read after dropping key1: %v", err)
	}
	if _, err := c.CoreV1().ConfigMaps(ns).Get(ctx, "c-0", metav1.GetOptions{}); err != nil {
		t.Fatalf("read after dropping key1: %v", err)
	}
	if _, body := getStorageDoc(t, s); strings.Contains(body, key1) || strings.Contains(body, key2) {
		t.Fatal("the status document holds key material")
	}
	t.Logf("create %v; rotation to key2 migrated in %v; to KMS v2 in %v; total %v",
		created.Sub(start).Round(time.Millisecond), rotated.Sub(created).Round(time.Millisecond),
		toKMS.Sub(rotated).Round(time.Millisecond), time.Since(start).Round(time.Millisecond))
}

// With --storage-migration=false the shim only counts: after key2 becomes the write key
// the objects stay on key1, and an edit that drops key1 is refused with a message
// naming the resource, the key and the object count, while the old configuration keeps
// serving reads and writes.
func TestShimRefusesDroppingKeyInUse(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	const prefix = "/e2e-guard"
	const k1, k2 = "k8s:enc:aesgcm:v1:key1:", "k8s:enc:aesgcm:v1:key2:"
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", key1)}, []string{identity}))
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdPrefix: prefix,
		Args: []string{"--storage-migration=false", "--storage-migration-check-interval", "250ms"}})
	c := clientFor(t, s)
	ns := "guard"
	const n = 30
	for i := range n {
		if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s-%d", i)},
			Data: map[string][]byte{"v": []byte("init")}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	writeConfig(t, config, encryptionConfig([]string{aesgcm("key2", key2), aesgcm("key1", key1)}, []string{identity}))
	eventually(t, 30*time.Second, 100*time.Millisecond, "inventory under key2", func() error {
		d, _ := getStorageDoc(t, s)
		if d.Storage == nil || d.Storage.Inventory == nil {
			return fmt.Errorf("no inventory")
		}
		for _, r := range d.Storage.Inventory.Resources {
			if r.Resource == "secrets" && r.WritePrefix == k2 && r.Stale == n {
				return nil
			}
		}
		return fmt.Errorf("inventory %+v", d.Storage.Inventory.Resources)
	})
	time.Sleep(time.Second) // several controller checks: still nothing may be rewritten
	if got := rawPrefixes(t, ctx, prefix+"/secrets/"); got[k1] != n || len(got) != 1 {
		t.Fatalf("with --storage-migration=false, stored: %v", got)
	}
	if d, _ := getStorageDoc(t, s); d.Storage.AutoMigrate || d.Storage.LastMigration != nil {
		t.Fatalf("with --storage-migration=false: %+v", d.Storage)
	}

	before, _ := getStorageDoc(t, s)
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key2", key2)}, []string{identity}))
	var refusal string
	eventually(t, 20*time.Second, 100*time.Millisecond, "refused reload", func() error {
		d, _ := getStorageDoc(t, s)
		if d.ReloadsFailed <= before.ReloadsFailed {
			return fmt.Errorf("not refused yet: %+v", d)
		}
		refusal = d.LastError
		return nil
	})
	t.Logf("refusal: %s", refusal)
	for _, want := range []string{"secrets", `"key1"`, fmt.Sprintf("%d objects", n), "unsafe-allow-dropping-keys-in-use"} {
		if !strings.Contains(refusal, want) {
			t.Errorf("refusal does not name %s: %s", want, refusal)
		}
	}
	if strings.Contains(refusal, key1) || strings.Contains(refusal, key2) {
		t.Fatal("the refusal holds key material")
	}
	after, _ := getStorageDoc(t, s)
	if after.ActiveConfigHash != before.ActiveConfigHash || after.ReloadsSucceeded != before.ReloadsSucceeded {
		t.Fatalf("the refused config was applied: %s → %s", before.ActiveConfigHash, after.ActiveConfigHash)
	}
	// The old configuration keeps serving: old objects read, new ones are written with key2.
	if got, err := c.CoreV1().Secrets(ns).Get(ctx, "s-0", metav1.GetOptions{}); err != nil || string(got.Data["v"]) != "init" {
		t.Fatalf("read of a key1 object after the refusal: %v", err)
	}
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "after"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if got := rawPrefixes(t, ctx, prefix+"/secrets/"+ns+"/after"); got[k2] != 1 {
		t.Fatalf("write after the refusal stored as %v", got)
	}
	hc, err := s.HTTPClient(true)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Get(s.URL + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	m, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if !strings.Contains(string(m), `rekey_storage_guard_refusals_total{check="change"} 1`) ||
		!strings.Contains(string(m), `rekey_storage_objects{key="key1",key_id_hash="",provider="aesgcm",resource="secrets",state="stale"} 30`) {
		t.Errorf("/metrics lacks the refusal or the stale count:\n%s", grepLines(string(m), "rekey_storage_"))
	}

	// The refused configuration is still on disk: a restart must not apply it silently.
	s.Stop(15 * time.Second)
	cfg := testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdPrefix: prefix, EtcdServers: []string{etcd.Endpoint},
		Args: []string{"--storage-migration=false", "--coordination-prefix", coordinationPrefix(t)}}
	args, err := testbed.ShimArgs(cfg)
	if err != nil {
		t.Fatal(err)
	}
	p, err := testbed.Start("shim-restart", dir, bins.Shim, args...)
	if err != nil {
		t.Fatal(err)
	}
	log := refusedToStart(t, p, 60*time.Second, "with the refused configuration", 4000)
	for _, want := range []string{"refusing to start", fmt.Sprintf(`secrets: %d objects are stored under aesgcm key "key1"`, n), "unsafe-allow-dropping-keys-in-use"} {
		if !strings.Contains(log, want) {
			t.Errorf("start-up refusal lacks %q:\n%s", want, log)
		}
	}
	if strings.Contains(log, key1) {
		t.Fatal("the start-up refusal holds key material")
	}
	// With the override it starts.
	cfg.Name = "shim-override"
	cfg.Args = append(cfg.Args, "--unsafe-allow-dropping-keys-in-use")
	startShim(t, cfg)
}

func grepLines(s, substr string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, substr) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
