package e2e

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The bounds of TestKMSPluginAbsentAndGone. The product answers a read under a missing
// plugin in milliseconds; the bounds leave room for a loaded 2-core CI machine.
const (
	absentReadP99Bound = 500 * time.Millisecond
	absentStatusEvery  = 2 * time.Second
	// absentRecoverySlack is added to one Status interval for the return to full service
	// (a reconnect within a second, the watch cache's re-list a second after a failure).
	absentRecoverySlack = 3 * time.Second
)

// An apiserver whose KMS plugin is absent at its start, and later gone while it
// serves, keeps serving what it can: ConfigMaps (not encrypted) at once; reads of
// Secrets (KMS v2) whose DEK is not cached fail in milliseconds with a 503 naming the
// provider (GET, LIST through the watch cache and past it); Secret creates get 503
// with Retry-After; /livez stays 200 while /readyz fails. The plugin's return restores
// full service within one Status interval, without a restart.
func TestKMSPluginAbsentAndGone(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	const provider, ns = "absent-kms", "absent"
	plugin := startPlugin(t, dir)
	sockDir := filepath.Dir(plugin.Socket)
	cfgPath := filepath.Join(dir, "encryption.yaml")
	// kube's default KMS timeout: a read that waited for the plugin would take 3 s.
	writeConfig(t, cfgPath, "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n"+
		"- resources: [secrets]\n  providers:\n"+
		fmt.Sprintf("  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: %s\n      timeout: 3s\n", provider, plugin.Endpoint)+
		"- resources: [configmaps]\n  providers:\n"+identity)
	// Its own etcd prefix: a repeated run (-count) must not meet the Secrets of the last
	// one, sealed under another plugin key.
	prefix := uniquePrefix(t)
	shimCfg := testbed.ShimConfig{Dir: filepath.Join(dir, "shim"), EncryptionConfig: cfgPath, EtcdServers: []string{etcd.Endpoint}, EtcdPrefix: prefix,
		Args: []string{"--kms-status-interval", absentStatusEvery.String(), "--coordination-prefix", coordinationPrefix(t) + prefix}}

	// Data written with the plugin up, by a shim that then stops.
	const stored = 5
	{
		s := startShim(t, shimCfg)
		c := clientFor(t, s)
		for i := range stored {
			if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s-%d", i)},
				StringData: map[string]string{"v": "secret"}}, metav1.CreateOptions{}); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := c.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm-0"},
			Data: map[string]string{"v": "plain"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		s.Stop(15 * time.Second)
		plugin.Stop(5 * time.Second)
	}

	// 1. The plugin is absent at the start.
	launched := time.Now()
	s, err := testbed.LaunchShim(ctx, bins.Shim, shimCfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Stop(15 * time.Second)
		if t.Failed() {
			t.Logf("shim log tail:\n%s", s.Log(4000))
		}
	})
	listening := time.Since(launched)
	c := clientFor(t, s)
	var cmServed time.Duration
	eventually(t, 30*time.Second, 10*time.Millisecond, "a ConfigMap served with the plugin absent", func() error {
		_, err := c.CoreV1().ConfigMaps(ns).Get(ctx, "cm-0", metav1.GetOptions{})
		cmServed = time.Since(launched)
		return err
	})
	t.Logf("plugin absent at start: listening after %v, first ConfigMap served after %v", listening.Round(time.Millisecond), cmServed.Round(time.Millisecond))
	if _, err := c.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: "cm-1"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("ConfigMap create with the plugin absent: %v", err)
	}
	if _, err := c.CoreV1().ConfigMaps(ns).List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatalf("ConfigMap list with the plugin absent: %v", err)
	}
	hc, err := s.HTTPClient(true)
	if err != nil {
		t.Fatal(err)
	}
	if code, body := httpGet(t, hc, s.URL+"/livez"); code != http.StatusOK {
		t.Errorf("/livez with the plugin absent: %d %s", code, body)
	}
	if code, body := httpGet(t, hc, s.URL+"/readyz?verbose"); code == http.StatusOK || !strings.Contains(body, "[-]kms-providers failed") {
		t.Errorf("/readyz with the plugin absent: %d %s, want the kms-providers check failing", code, body)
	}

	reads := readFailures(t, c, ns, "s-0", provider, 20)
	t.Logf("Secret GET with the plugin absent: %s", reads)
	for _, limit := range []int64{0, 500} { // 0: from the watch cache; 500: kubectl's, past it
		start := time.Now()
		_, err := c.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{Limit: limit})
		took := time.Since(start)
		if !apierrors.IsServiceUnavailable(err) || !strings.Contains(err.Error(), provider) || took > time.Second {
			t.Errorf("Secret LIST (limit %d) with the plugin absent: %v after %v, want a 503 naming %q in under a second", limit, err, took, provider)
		}
		t.Logf("Secret LIST (limit %d) with the plugin absent: 503 after %v", limit, took.Round(time.Microsecond))
	}
	create := func(name string) (int, string, string) {
		body := fmt.Sprintf(`{"apiVersion":"v1","kind":"Secret","metadata":{"name":%q},"stringData":{"v":"x"}}`, name)
		req, err := http.NewRequestWithContext(ctx, http.MethodPost, s.URL+"/api/v1/namespaces/"+ns+"/secrets", strings.NewReader(body))
		if err != nil {
			t.Fatal(err)
		}
		req.Header.Set("Content-Type", "application/json")
		resp, err := hc.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, resp.Header.Get("Retry-After"), string(b)
	}
	if code, retry, body := create("refused"); code != http.StatusServiceUnavailable || retry == "" || !strings.Contains(body, provider) {
		t.Errorf("Secret create with the plugin absent: %d Retry-After %q %s, want 503 with Retry-After naming %q", code, retry, body, provider)
	}

	// 2. The plugin comes: full service without a restart, within one Status interval.
	plugin, err = testbed.StartPlugin(ctx, bins.Plugin, dir, sockDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plugin.Stop(5 * time.Second) })
	back := time.Now()
	recovered := waitFullService(t, c, ns, "s-0", "after-start", absentStatusEvery+absentRecoverySlack)
	t.Logf("full service %v after the plugin started (Status interval %v)", recovered.Round(time.Millisecond), absentStatusEvery)
	if err := s.Readyz(ctx); err != nil {
		// The kms-providers check caches a failure for 3 s: wait on it, not on a sleep.
		eventually(t, 10*time.Second, 50*time.Millisecond, "/readyz after the plugin came", func() error { return s.Readyz(ctx) })
	}
	t.Logf("ready %v after the plugin started", time.Since(back).Round(time.Millisecond))

	// 3. The plugin goes while serving. A Secret another apiserver wrote under a DEK this
	// one never saw appears meanwhile: its read needs the plugin.
	up, err := testbed.Upstream(ctx, cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	coldKey := prefix + "/secrets/" + ns + "/cold"
	plain, err := testbed.NewStorageCodec().Encode(&corev1.Secret{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Name: "cold", Namespace: ns, UID: "0b7a6c3e-cold", CreationTimestamp: metav1.Now()},
		Data:       map[string][]byte{"v": []byte("cold")}})
	if err != nil {
		t.Fatal(err)
	}
	sealed, err := up.TransformerForResource(schema.GroupResource{Resource: "secrets"}).TransformToStorage(ctx, plain, value.DefaultContext(coldKey))
	if err != nil {
		t.Fatal(err)
	}
	plugin.Kill()
	if _, err := cli.Put(ctx, coldKey, string(sealed)); err != nil {
		t.Fatal(err)
	}
	for i := range stored { // cached DEK: served
		if _, err := c.CoreV1().Secrets(ns).Get(ctx, fmt.Sprintf("s-%d", i), metav1.GetOptions{}); err != nil {
			t.Fatalf("read of a Secret under a cached DEK with the plugin gone: %v", err)
		}
	}
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "in-window"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("write inside the write window with the plugin gone: %v", err)
	}
	reads = readFailures(t, c, ns, "cold", provider, 20)
	t.Logf("Secret GET under an uncached DEK with the plugin gone: %s", reads)
	if code, body := httpGet(t, hc, s.URL+"/livez"); code != http.StatusOK {
		t.Errorf("/livez with the plugin gone: %d %s", code, body)
	}
	// The watch cache cannot take the new Secret in: once it gives up, LIST says why.
	var took time.Duration
	eventually(t, 15*time.Second, 50*time.Millisecond, "LIST of Secrets failing fast with the plugin gone", func() error {
		start := time.Now()
		_, err := c.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{})
		if took = time.Since(start); took > time.Second {
			t.Errorf("LIST with the plugin gone took %v", took)
		}
		if !apierrors.IsServiceUnavailable(err) || !strings.Contains(err.Error(), provider) {
			return fmt.Errorf("LIST: %v, want a 503 naming %q", err, provider)
		}
		return nil
	})
	t.Logf("Secret LIST with the plugin gone: 503 after %v", took.Round(time.Microsecond))

	plugin, err = testbed.StartPlugin(ctx, bins.Plugin, dir, sockDir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plugin.Stop(5 * time.Second) })
	recovered = waitFullService(t, c, ns, "cold", "after-restart", absentStatusEvery+absentRecoverySlack)
	t.Logf("full service %v after the plugin restarted", recovered.Round(time.Millisecond))
}

// latencies summarises a run of timed requests.
type latencies []time.Duration

func (l latencies) p99() time.Duration {
	s := slices.Clone(l)
	slices.Sort(s)
	return s[min(len(s)-1, len(s)*99/100)]
}

func (l latencies) String() string {
	s := slices.Clone(l)
	slices.Sort(s)
	return fmt.Sprintf("%d reads, p50 %v, p99 %v, max %v", len(s), s[len(s)/2].Round(time.Microsecond), l.p99().Round(time.Microsecond), s[len(s)-1].Round(time.Microsecond))
}

// readFailures GETs Secret name n times, requires each to fail with a 503 naming
// provider, and the p99 to stay under absentReadP99Bound.
func readFailures(t *testing.T, c *kubernetes.Clientset, ns, name, provider string, n int) latencies {
	t.Helper()
	var l latencies
	for range n {
		start := time.Now()
		_, err := c.CoreV1().Secrets(ns).Get(t.Context(), name, metav1.GetOptions{})
		l = append(l, time.Since(start))
		if !apierrors.IsServiceUnavailable(err) || !strings.Contains(err.Error(), provider) {
			t.Fatalf("GET of Secret %s with the plugin unavailable: %v, want a 503 naming provider %q", name, err, provider)
		}
	}
	if p := l.p99(); p > absentReadP99Bound {
		t.Errorf("GET of Secret %s with the plugin unavailable: p99 %v, want under %v (%s)", name, p, absentReadP99Bound, l)
	}
	return l
}

// waitFullService polls until a GET of Secret name, a LIST of Secrets and a Secret
// create all succeed, and returns how long that took; it fails the test after bound.
func waitFullService(t *testing.T, c *kubernetes.Clientset, ns, name, create string, bound time.Duration) time.Duration {
	t.Helper()
	start := time.Now()
	created := false
	eventually(t, bound, 20*time.Millisecond, "full service", func() error {
		ctx, cancel := context.WithTimeout(t.Context(), 5*time.Second)
		defer cancel()
		if _, err := c.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{}); err != nil {
			return fmt.Errorf("GET %s: %w", name, err)
		}
		if _, err := c.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); err != nil {
			return fmt.Errorf("LIST: %w", err)
		}
		if !created {
			if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: create}}, metav1.CreateOptions{}); err != nil {
				return fmt.Errorf("create: %w", err)
			}
			created = true
		}
		return nil
	})
	return time.Since(start)
}

// httpGet returns the status code and body of a GET.
func httpGet(t *testing.T, hc *http.Client, url string) (int, string) {
	t.Helper()
	resp, err := hc.Get(url)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(b)
}
