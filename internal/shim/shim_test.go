package shim_test

import (
	"bytes"
	"context"
	"crypto/fips140"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/authentication/user"
	corev1apply "k8s.io/client-go/applyconfigurations/core/v1"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/layer"
)

const token = "shim-test-token"

// One shim and one embedded etcd serve the whole package: a start and graceful stop
// costs about two seconds.
var (
	info       shim.Info
	configPath string
	client     *kubernetes.Clientset
	restConfig *rest.Config
)

const encryptionConfig = `apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - aesgcm:
      keys: [{name: key1, secret: %q}]
  - identity: {}
- resources: [configmaps]
  providers:
  - aescbc:
      keys: [{name: cbc1, secret: %q}]
`

func TestMain(m *testing.M) {
	os.Exit(testbed.MainWithLeakCheck(func() int { return runMain(m) }))
}

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "shim-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	configPath = filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(configPath, fmt.Appendf(nil, encryptionConfig, testbed.RandomKey(), testbed.RandomKey()), 0o600); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}

	// Under GODEBUG=fips140=only the embedded etcd cannot start (SHA-1 member ids):
	// the shim uses an etcdtest member (a process) there.
	var etcdServers []string
	if fips140.Enforced() {
		srv, err := etcdtest.New(filepath.Join(dir, "etcdtest"), etcdtest.Options{})
		if err != nil {
			fmt.Fprintln(os.Stderr, err)
			return 1
		}
		defer srv.Close()
		etcdServers = []string{srv.Endpoint}
	}
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	begin := time.Now()
	go func() {
		done <- shim.Run(ctx, shim.Options{
			EncryptionConfig:  configPath,
			AutomaticReload:   true,
			Rekey:             layer.Flags{StorageMigration: true},
			EtcdServers:       etcdServers,
			DataDir:           filepath.Join(dir, "etcd"),
			EtcdUnsafeNoFsync: true,
			CertDir:           filepath.Join(dir, "certs"),
			Tokens:            map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
			MetricsRegistry:   metrics.NewKubeRegistry(),
			Started:           func(i shim.Info) { started <- i },
		})
	}()
	defer func() {
		cancel()
		<-done
	}()
	select {
	case info = <-started:
	case err := <-done:
		fmt.Fprintln(os.Stderr, "shim did not start:", err)
		return 1
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "shim did not start within 60s")
		return 1
	}
	restConfig = &rest.Config{Host: info.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: info.CAFile}}
	client = kubernetes.NewForConfigOrDie(restConfig)
	if err := waitReady(ctx); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "shim ready %v after Run\n", time.Since(begin).Round(time.Millisecond))
	return m.Run()
}

func waitReady(ctx context.Context) error {
	deadline := time.Now().Add(30 * time.Second)
	for {
		body, err := client.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready: %v: %s", err, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func TestSecretLifecycleEncryptedInEtcd(t *testing.T) {
	ctx := t.Context()
	secrets := client.CoreV1().Secrets("lifecycle")
	created, err := secrets.Create(ctx, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "s1", Labels: map[string]string{"app": "a"}},
		StringData: map[string]string{"password": "hunter2-plaintext"},
	}, metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("create: %v", err)
	}
	if created.Type != corev1.SecretTypeOpaque || string(created.Data["password"]) != "hunter2-plaintext" || created.StringData != nil {
		t.Fatalf("create returned %+v", created)
	}

	cli, err := testbed.EtcdClient(info.EtcdServers)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(ctx, "/registry/secrets/lifecycle/s1")
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("raw etcd read: %v %v", resp, err)
	}
	raw := resp.Kvs[0].Value
	if !bytes.HasPrefix(raw, []byte("k8s:enc:aesgcm:v1:key1:")) {
		t.Fatalf("stored prefix %q", raw[:min(len(raw), 30)])
	}
	if bytes.Contains(raw, []byte("hunter2")) {
		t.Fatal("plaintext in etcd")
	}

	// kube-apiserver's own transformers read what the shim wrote.
	up, err := testbed.Upstream(ctx, configPath)
	if err != nil {
		t.Fatal(err)
	}
	_, obj, err := testbed.ReadStored(ctx, cli, up, corev1.Resource("secrets"), "/registry/secrets/lifecycle/s1")
	if err != nil {
		t.Fatalf("upstream read: %v", err)
	}
	if s := obj.(*corev1.Secret); string(s.Data["password"]) != "hunter2-plaintext" {
		t.Fatalf("upstream decoded %+v", s)
	}

	w, err := secrets.Watch(ctx, metav1.ListOptions{ResourceVersion: created.ResourceVersion})
	if err != nil {
		t.Fatalf("watch: %v", err)
	}
	defer w.Stop()

	got, err := secrets.Get(ctx, "s1", metav1.GetOptions{})
	if err != nil || string(got.Data["password"]) != "hunter2-plaintext" {
		t.Fatalf("get: %v %+v", err, got)
	}
	got.Data["user"] = []byte("root")
	if _, err := secrets.Update(ctx, got, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("update: %v", err)
	}
	if _, err := secrets.Patch(ctx, "s1", types.MergePatchType, []byte(`{"metadata":{"labels":{"patched":"yes"}}}`), metav1.PatchOptions{}); err != nil {
		t.Fatalf("patch: %v", err)
	}
	applied, err := secrets.Apply(ctx, corev1apply.Secret("s1", "lifecycle").WithStringData(map[string]string{"applied": "1"}),
		metav1.ApplyOptions{FieldManager: "test", Force: true})
	if err != nil {
		t.Fatalf("server-side apply: %v", err)
	}
	if string(applied.Data["applied"]) != "1" || string(applied.Data["password"]) != "hunter2-plaintext" {
		t.Fatalf("apply result %+v", applied.Data)
	}
	list, err := secrets.List(ctx, metav1.ListOptions{LabelSelector: "app=a"})
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("list: %v %+v", err, list)
	}
	fieldList, err := secrets.List(ctx, metav1.ListOptions{FieldSelector: "type=Opaque"})
	if err != nil || len(fieldList.Items) != 1 {
		t.Fatalf("list by type: %v %+v", err, fieldList)
	}
	if err := secrets.Delete(ctx, "s1", metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete: %v", err)
	}
	if _, err := secrets.Get(ctx, "s1", metav1.GetOptions{}); !apierrors.IsNotFound(err) {
		t.Fatalf("get after delete: %v", err)
	}

	var events []watch.EventType
	timeout := time.After(10 * time.Second)
	for len(events) < 4 {
		select {
		case ev := <-w.ResultChan():
			events = append(events, ev.Type)
		case <-timeout:
			t.Fatalf("watch saw %v", events)
		}
	}
	want := []watch.EventType{watch.Modified, watch.Modified, watch.Modified, watch.Deleted}
	if fmt.Sprint(events) != fmt.Sprint(want) {
		t.Fatalf("watch events %v, want %v", events, want)
	}
}

func TestUpstreamWrittenValueReadsThroughShim(t *testing.T) {
	ctx := t.Context()
	cli, err := testbed.EtcdClient(info.EtcdServers)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	up, err := testbed.Upstream(ctx, configPath)
	if err != nil {
		t.Fatal(err)
	}
	cm := &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "from-upstream", Namespace: "interop", UID: "u-1", CreationTimestamp: metav1.Now()},
		Data:       map[string]string{"k": "written-by-upstream"},
	}
	key := "/registry/configmaps/interop/from-upstream"
	if err := testbed.WriteStored(ctx, cli, up, corev1.Resource("configmaps"), key, cm); err != nil {
		t.Fatal(err)
	}
	resp, _ := cli.Get(ctx, key)
	if !bytes.HasPrefix(resp.Kvs[0].Value, []byte("k8s:enc:aescbc:v1:cbc1:")) {
		t.Fatalf("upstream wrote %q", resp.Kvs[0].Value[:30])
	}
	got, err := client.CoreV1().ConfigMaps("interop").Get(ctx, "from-upstream", metav1.GetOptions{})
	if err != nil || got.Data["k"] != "written-by-upstream" {
		t.Fatalf("get through shim: %v %+v", err, got)
	}
}

func TestValidation(t *testing.T) {
	ctx := t.Context()
	_, err := client.CoreV1().ConfigMaps("v").Create(ctx, &corev1.ConfigMap{
		ObjectMeta: metav1.ObjectMeta{Name: "bad"}, Data: map[string]string{"no/slash": "x"},
	}, metav1.CreateOptions{})
	if !apierrors.IsInvalid(err) {
		t.Fatalf("bad key: %v", err)
	}
	_, err = client.CoreV1().Secrets("v").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "UPPER"}}, metav1.CreateOptions{})
	if !apierrors.IsInvalid(err) {
		t.Fatalf("bad name: %v", err)
	}
}

func TestAuthAndEndpoints(t *testing.T) {
	anon := &http.Client{Transport: mustTransport(t, &rest.Config{Host: info.URL, TLSClientConfig: rest.TLSClientConfig{CAFile: info.CAFile}})}
	authed := &http.Client{Transport: mustTransport(t, restConfig)}
	for _, tc := range []struct {
		client *http.Client
		path   string
		want   int
	}{
		{anon, "/api/v1/secrets", http.StatusUnauthorized},
		{anon, "/metrics", http.StatusUnauthorized},
		{anon, "/version", http.StatusUnauthorized},
		{anon, "/healthz", http.StatusOK},
		{anon, "/livez", http.StatusOK},
		{anon, "/readyz", http.StatusOK},
		{anon, "/readyz/etcd-readiness", http.StatusOK},
		{anon, "/healthz/kms-providers", http.StatusOK},
		{anon, "/readyz/kms-providers", http.StatusOK},
		{anon, "/livez/kms-providers", http.StatusNotFound},
		{authed, "/api/v1/secrets", http.StatusOK},
		{authed, "/metrics", http.StatusOK},
		{authed, "/openapi/v3", http.StatusOK},
		{authed, info.StatusPath, http.StatusOK},
	} {
		resp, err := tc.client.Get(info.URL + tc.path)
		if err != nil {
			t.Fatalf("%s: %v", tc.path, err)
		}
		body, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		if resp.StatusCode != tc.want {
			t.Errorf("GET %s: %d, want %d: %s", tc.path, resp.StatusCode, tc.want, body)
		}
		if tc.path == info.StatusPath && !json.Valid(body) {
			t.Errorf("status document is not JSON: %s", body)
		}
	}
	res, err := client.Discovery().ServerResourcesForGroupVersion("v1")
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, r := range res.APIResources {
		names = append(names, r.Name+fmt.Sprint(r.ShortNames))
	}
	if got := strings.Join(names, " "); !strings.Contains(got, "configmaps[cm]") || !strings.Contains(got, "secrets[]") {
		t.Fatalf("discovery: %s", got)
	}
}

func mustTransport(t *testing.T, c *rest.Config) http.RoundTripper {
	t.Helper()
	rt, err := rest.TransportFor(c)
	if err != nil {
		t.Fatal(err)
	}
	return rt
}

// The rekey layer's storage controller: its inventory of secrets and configmaps is in
// the status document under "storage" and in /metrics as rekey_storage_*.
func TestStorageInventoryInStatusAndMetrics(t *testing.T) {
	ctx := t.Context()
	// The server is shared by the package's tests (and by -count runs): the secret may
	// already be there.
	if _, err := client.CoreV1().Secrets("inventory").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}}, metav1.CreateOptions{}); err != nil && !apierrors.IsAlreadyExists(err) {
		t.Fatal(err)
	}
	authed := &http.Client{Transport: mustTransport(t, restConfig)}
	get := func(path string) []byte {
		resp, err := authed.Get(info.URL + path)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		if resp.StatusCode != http.StatusOK {
			t.Fatalf("GET %s: %d %s", path, resp.StatusCode, body)
		}
		return body
	}
	var doc struct {
		ActiveConfigHash string `json:"activeConfigHash"`
		Storage          *struct {
			AutoMigrate bool `json:"autoMigrate"`
			Inventory   *struct {
				ConfigHash string `json:"configHash"`
				Resources  []struct {
					Resource    string `json:"resource"`
					KeyPrefix   string `json:"keyPrefix"`
					WritePrefix string `json:"writePrefix"`
				} `json:"resources"`
			} `json:"inventory"`
		} `json:"storage"`
	}
	deadline := time.Now().Add(20 * time.Second)
	for {
		if err := json.Unmarshal(get(info.StatusPath), &doc); err != nil {
			t.Fatal(err)
		}
		if doc.Storage != nil && doc.Storage.Inventory != nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("no inventory in the status document: %s", get(info.StatusPath))
		}
		time.Sleep(50 * time.Millisecond)
	}
	inv := doc.Storage.Inventory
	if !doc.Storage.AutoMigrate || inv.ConfigHash != doc.ActiveConfigHash || len(inv.Resources) != 2 ||
		inv.Resources[0].Resource != "secrets" || inv.Resources[0].KeyPrefix != "/registry/secrets/" ||
		inv.Resources[1].Resource != "configmaps" || inv.Resources[1].KeyPrefix != "/registry/configmaps/" {
		t.Fatalf("storage section: %s", get(info.StatusPath))
	}
	m := string(get("/metrics"))
	for _, name := range []string{"rekey_storage_inventory_last_timestamp_seconds", "rekey_storage_guard_refusals_total", "rekey_storage_migration_running"} {
		if !strings.Contains(m, name) {
			t.Errorf("/metrics lacks %s", name)
		}
	}
}
