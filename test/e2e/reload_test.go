package e2e

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// reloadStatus is the part of the agent's status document the tests read.
type reloadStatus struct {
	ActiveConfigHash string `json:"activeConfigHash"`
	ReloadsSucceeded int64  `json:"reloadsSucceeded"`
	ReloadsFailed    int64  `json:"reloadsFailed"`
	LastError        string `json:"lastError"`
	Resources        []struct {
		Resource    string `json:"resource"`
		WritePrefix string `json:"writePrefix"`
	} `json:"resources"`
}

func getStatus(t *testing.T, s *testbed.Shim) reloadStatus {
	t.Helper()
	st, _ := statusDoc[reloadStatus](t, s)
	return st
}

// statusDoc fetches the agent's status document, decodes it into T and also returns
// the raw body (for checks that no key material appears in it).
func statusDoc[T any](t *testing.T, s *testbed.Shim) (T, string) {
	t.Helper()
	var doc T
	hc, err := s.HTTPClient(true)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Get(s.URL + "/rekey/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("status document: %s %s", resp.Status, body)
	}
	if err := json.Unmarshal(body, &doc); err != nil {
		t.Fatal(err)
	}
	return doc, string(body)
}

// writer creates and updates Secrets in a loop until stopped, counting failures.
type writer struct {
	stop     chan struct{}
	wg       sync.WaitGroup
	ok, fail atomic.Int64
	mu       sync.Mutex
	errs     []string
}

func startWriters(t *testing.T, c *kubernetes.Clientset, ns string, n int) *writer {
	w := &writer{stop: make(chan struct{})}
	for g := range n {
		w.wg.Go(func() {
			secrets := c.CoreV1().Secrets(ns)
			for i := 0; ; i++ {
				select {
				case <-w.stop:
					return
				default:
				}
				name := fmt.Sprintf("w%d-%d", g, i)
				s, err := secrets.Create(t.Context(), &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
					StringData: map[string]string{"v": name}}, metav1.CreateOptions{})
				if err == nil {
					s.Data["u"] = []byte("updated")
					_, err = secrets.Update(t.Context(), s, metav1.UpdateOptions{})
				}
				if err == nil {
					_, err = secrets.Get(t.Context(), name, metav1.GetOptions{})
				}
				if err != nil {
					w.fail.Add(1)
					w.mu.Lock()
					w.errs = append(w.errs, err.Error())
					w.mu.Unlock()
				} else {
					w.ok.Add(1)
				}
			}
		})
	}
	return w
}

func (w *writer) finish() (ok, fail int64, errs []string) {
	close(w.stop)
	w.wg.Wait()
	return w.ok.Load(), w.fail.Load(), w.errs
}

// An edit of the config while writers run changes the write key within moments, with
// no failed request, and values written before stay readable.
func TestReloadUnderWriter(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", key1), identity}, []string{identity}))
	// The reload path alone: automatic storage migration would rewrite objects under the
	// writers, whose blind updates would then meet 409 conflicts they do not retry.
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, Args: []string{"--storage-migration=false"}})
	c := clientFor(t, s)
	ns := "reload-writer"
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "old"},
		StringData: map[string]string{"v": "old"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	rawPrefix := func(name string) string {
		resp, err := cli.Get(ctx, "/registry/secrets/"+ns+"/"+name)
		if err != nil || len(resp.Kvs) != 1 {
			return ""
		}
		v := resp.Kvs[0].Value
		return string(v[:min(len(v), len("k8s:enc:aesgcm:v1:keyN:"))])
	}
	if p := rawPrefix("old"); p != "k8s:enc:aesgcm:v1:key1:" {
		t.Fatalf("before reload: %q", p)
	}

	w := startWriters(t, c, ns, 4)
	time.Sleep(time.Second)
	edited := time.Now()
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key2", key2), aesgcm("key1", key1), identity}, []string{identity}))
	var took time.Duration
	eventually(t, 20*time.Second, 20*time.Millisecond, "new writes under key2", func() error {
		name := fmt.Sprintf("probe-%d", time.Now().UnixNano())
		if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			return err
		}
		if p := rawPrefix(name); p != "k8s:enc:aesgcm:v1:key2:" {
			return fmt.Errorf("written as %q", p)
		}
		took = time.Since(edited)
		return nil
	})
	time.Sleep(time.Second)
	ok, fail, errs := w.finish()
	t.Logf("edit → first write under key2: %v; writer loops: %d ok, %d failed", took.Round(time.Millisecond), ok, fail)
	if fail > 0 {
		t.Errorf("%d failed requests during the reload, e.g. %s", fail, errs[0])
	}
	if ok == 0 {
		t.Error("the writers made no progress")
	}
	if got, err := c.CoreV1().Secrets(ns).Get(ctx, "old", metav1.GetOptions{}); err != nil || string(got.Data["v"]) != "old" {
		t.Errorf("value written under key1 after the reload: %v", err)
	}
	if st := getStatus(t, s); st.ReloadsSucceeded < 1 || !strings.Contains(fmt.Sprint(st.Resources), "k8s:enc:aesgcm:v1:key2:") {
		t.Errorf("status after reload: %+v", st)
	}
}

// A broken edit is refused: the server keeps serving with the previous configuration,
// stays ready, and the status document names the error.
func TestBadConfigKeepsServing(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", testbed.RandomKey()), identity}, []string{identity}))
	// The reload path alone: automatic storage migration would rewrite objects under the
	// writers, whose blind updates would then meet 409 conflicts they do not retry.
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, Args: []string{"--storage-migration=false"}})
	c := clientFor(t, s)
	ns := "bad-config"
	w := startWriters(t, c, ns, 2)
	before := getStatus(t, s)

	for i, bad := range []string{
		"this is: [not an EncryptionConfiguration",
		encryptionConfig([]string{aesgcm("short", "dG9vLXNob3J0")}, []string{identity}),
	} {
		writeConfig(t, config, bad)
		eventually(t, 20*time.Second, 50*time.Millisecond, "refused reload", func() error {
			st := getStatus(t, s)
			if st.ReloadsFailed >= int64(i+1) && st.LastError != "" {
				return nil
			}
			return fmt.Errorf("status %+v", st)
		})
	}
	time.Sleep(500 * time.Millisecond) // keep writing with the bad file in place
	ok, fail, errs := w.finish()
	if fail > 0 {
		t.Errorf("%d failed requests with a bad config on disk, e.g. %s", fail, errs[0])
	}
	st := getStatus(t, s)
	if st.ActiveConfigHash != before.ActiveConfigHash {
		t.Errorf("active config changed to %s", st.ActiveConfigHash)
	}
	t.Logf("writer loops %d ok; refused: %s", ok, st.LastError)
	hc, err := s.HTTPClient(false)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Get(s.URL + "/readyz")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/readyz with a bad config on disk: %d", resp.StatusCode)
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "after"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	resp2, err := cli.Get(ctx, "/registry/secrets/"+ns+"/after")
	if err != nil || len(resp2.Kvs) != 1 || !bytes.HasPrefix(resp2.Kvs[0].Value, []byte("k8s:enc:aesgcm:v1:key1:")) {
		t.Errorf("write after refused reloads not under key1: %v", err)
	}
}
