package e2e

import (
	"bufio"
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
)

// workDir is the run's scratch directory (set by TestMain, removed after the run).
var workDir string

// skipKubeAPIServerEnv skips the tests of dist/kube-apiserver, whose first build
// compiles k8s.io/kubernetes.
const skipKubeAPIServerEnv = "REKEY_SKIP_KUBE_APISERVER"

var (
	kapiOnce sync.Once
	kapiBins testbed.KubeAPIServerBinaries
	kapiErr  error
)

// kubeAPIServers builds dist/kube-apiserver and upstream's kube-apiserver once per run.
func kubeAPIServers(t *testing.T) testbed.KubeAPIServerBinaries {
	t.Helper()
	if os.Getenv(skipKubeAPIServerEnv) == "1" {
		t.Skipf("%s=1: not building or testing dist/kube-apiserver (k8s.io/kubernetes)", skipKubeAPIServerEnv)
	}
	kapiOnce.Do(func() {
		start := time.Now()
		kapiBins, kapiErr = testbed.BuildKubeAPIServer(context.Background(), filepath.Join(workDir, "kapi-bin"), true)
		fmt.Fprintf(os.Stderr, "e2e: built dist/kube-apiserver and upstream kube-apiserver in %v\n", time.Since(start).Round(time.Millisecond))
	})
	if kapiErr != nil {
		t.Fatal(kapiErr)
	}
	return kapiBins
}

// coordinationPrefix is the --coordination-prefix of the rekey apiservers and shims of t
// (their member records and applied encryption state live under it): a restart by hand
// must pass the same one to find its own state.
func coordinationPrefix(t *testing.T) string {
	return "/rekey-e2e/" + strings.NewReplacer("/", "-").Replace(t.Name())
}

func startKubeAPIServer(t *testing.T, bin string, c testbed.KubeAPIServerConfig) *testbed.Shim {
	t.Helper()
	if c.Dir == "" {
		c.Dir = t.TempDir()
	}
	if c.EtcdServers == nil {
		c.EtcdServers = []string{etcd.Endpoint}
	}
	if bin == kapiBins.Rekey && !slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--coordination-prefix") }) {
		// Tests share one etcd but are separate clusters: each coordinates under its own prefix.
		c.Args = append(c.Args, "--coordination-prefix", coordinationPrefix(t))
	}
	if bin == kapiBins.Rekey && !slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--encryption-state-id") }) {
		// Every apiserver on this host has the same identity, the default state id: each
		// test's apiserver records its applied configuration under its own key, as
		// apiservers of separate clusters would.
		c.Args = append(c.Args, "--encryption-state-id", strings.NewReplacer("/", "-").Replace(t.Name())+"-"+c.Name)
	}
	s, err := testbed.StartKubeAPIServer(t.Context(), bin, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%s ready in %v", s.Name, s.Ready.Round(time.Millisecond))
	t.Cleanup(func() {
		s.Stop(30 * time.Second)
		if t.Failed() {
			t.Logf("%s log tail:\n%s", s.Name, s.Log(4000))
		}
	})
	return s
}

// uniquePrefix is an etcd prefix of one cluster on the shared etcd.
func uniquePrefix(t *testing.T) string {
	t.Helper()
	b := make([]byte, 4)
	if _, err := rand.Read(b); err != nil {
		t.Fatal(err)
	}
	return "/kapi-" + hex.EncodeToString(b)
}

// rule renders one resources entry of an EncryptionConfiguration.
func rule(resources string, providers ...string) string {
	// Quoted: a bare `*` starts a YAML alias.
	return "- resources: [\"" + resources + "\"]\n  providers:\n" + strings.Join(providers, "")
}

func configOf(rules ...string) string {
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" + strings.Join(rules, "")
}

func get(t *testing.T, s *testbed.Shim, path string) (int, string) {
	t.Helper()
	hc, err := s.HTTPClient(true)
	if err != nil {
		t.Fatal(err)
	}
	resp, err := hc.Get(s.URL + path)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	return resp.StatusCode, string(body)
}

const widgetCRD = `apiVersion: apiextensions.k8s.io/v1
kind: CustomResourceDefinition
metadata: {name: widgets.example.com}
spec:
  group: example.com
  names: {kind: Widget, plural: widgets, singular: widget, listKind: WidgetList}
  scope: Namespaced
  versions:
  - name: v1
    served: true
    storage: true
    schema:
      openAPIV3Schema:
        type: object
        properties:
          spec: {type: object, x-kubernetes-preserve-unknown-fields: true}
`

// kube-apiserver with rekey inside, on an etcd process with the local KMS v2 plugin:
// kubectl creates and reads Secrets (KMS v2), ConfigMaps, a Deployment and a custom
// resource (matched by a `*.example.com` rule); etcd holds each under its rule's prefix
// and no plaintext, and upstream's transformers decrypt it. The KMS check, /metrics
// (every family once, upstream's names), the status document and a hot reload under
// writers with no failed request.
func TestKubeAPIServerWithRekey(t *testing.T) {
	bins := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	config := filepath.Join(dir, "encryption.yaml")
	cmKey, depKey, crdKey, key2 := testbed.RandomKey(), testbed.RandomKey(), testbed.RandomKey(), testbed.RandomKey()
	others := []string{
		rule("configmaps", aesgcm("cm1", cmKey), identity),
		rule("deployments.apps", aesgcm("dep1", depKey), identity),
		rule("*.example.com", aesgcm("crd1", crdKey), identity),
	}
	writeConfig(t, config, configOf(append([]string{rule("secrets", kms("local", plugin.Endpoint), identity)}, others...)...))
	prefix := uniquePrefix(t)
	s := startKubeAPIServer(t, bins.Rekey, testbed.KubeAPIServerConfig{Name: "kube-apiserver-rekey", Dir: filepath.Join(dir, "kapi"),
		EtcdPrefix: prefix, EncryptionConfig: config, AutomaticReload: true})

	ns := "kapi-e2e"
	kubectl := func(stdin string, args ...string) string {
		t.Helper()
		out, err := s.Kubectl(ctx, stdin, args...)
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	kubectl("", "create", "namespace", ns)
	kubectl("", "-n", ns, "create", "secret", "generic", "db", "--from-literal=password=kapi-plaintext-1")
	kubectl("", "-n", ns, "create", "configmap", "settings", "--from-literal=mode=kapi-plaintext-2")
	kubectl("", "-n", ns, "create", "deployment", "web", "--image=registry.k8s.io/pause:3.10", "--", "kapi-plaintext-3")
	kubectl(widgetCRD, "apply", "-f", "-")
	kubectl("", "wait", "--for=condition=Established", "--timeout=60s", "crd/widgets.example.com")
	widget := `{"apiVersion":"example.com/v1","kind":"Widget","metadata":{"name":"w1","namespace":"` + ns + `"},"spec":{"color":"kapi-plaintext-4"}}`
	eventually(t, 30*time.Second, 200*time.Millisecond, "create a Widget", func() error {
		_, err := s.Kubectl(ctx, widget, "apply", "-f", "-")
		return err
	})
	for _, c := range []struct{ args, want []string }{
		{[]string{"get", "secret", "db", "-o", "jsonpath={.data.password}"}, []string{"a2FwaS1wbGFpbnRleHQtMQ=="}},
		{[]string{"get", "configmap", "settings", "-o", "jsonpath={.data.mode}"}, []string{"kapi-plaintext-2"}},
		{[]string{"get", "deployment", "web"}, []string{"NAME", "web"}},
		{[]string{"get", "widgets", "w1", "-o", "jsonpath={.spec.color}"}, []string{"kapi-plaintext-4"}},
	} {
		out := kubectl("", append([]string{"-n", ns}, c.args...)...)
		for _, w := range c.want {
			if !strings.Contains(out, w) {
				t.Errorf("kubectl %v: %q, want %q in it", c.args, out, w)
			}
		}
	}

	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	up, err := testbed.Upstream(ctx, config)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		gr                     schema.GroupResource
		key, prefix, plaintext string
	}{
		{schema.GroupResource{Resource: "secrets"}, "/secrets/" + ns + "/db", "k8s:enc:kms:v2:local:", "kapi-plaintext-1"},
		{schema.GroupResource{Resource: "configmaps"}, "/configmaps/" + ns + "/settings", "k8s:enc:aesgcm:v1:cm1:", "kapi-plaintext-2"},
		{schema.GroupResource{Group: "apps", Resource: "deployments"}, "/deployments/" + ns + "/web", "k8s:enc:aesgcm:v1:dep1:", "kapi-plaintext-3"},
		{schema.GroupResource{Group: "example.com", Resource: "widgets"}, "/example.com/widgets/" + ns + "/w1", "k8s:enc:aesgcm:v1:crd1:", "kapi-plaintext-4"},
	} {
		key := prefix + c.key
		resp, err := cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Errorf("%s: not in etcd: %v", key, err)
			continue
		}
		raw := resp.Kvs[0].Value
		if !bytes.HasPrefix(raw, []byte(c.prefix)) {
			t.Errorf("%s: stored as %q…, want prefix %q", key, raw[:min(len(raw), len(c.prefix))], c.prefix)
		}
		if bytes.Contains(raw, []byte(c.plaintext)) {
			t.Errorf("%s: plaintext in etcd", key)
		}
		plain, _, err := up.TransformerForResource(c.gr).TransformFromStorage(ctx, raw, value.DefaultContext(key))
		if err != nil || !bytes.Contains(plain, []byte(c.plaintext)) {
			t.Errorf("%s: upstream's transformers: %v", key, err)
		}
	}

	for path, want := range map[string]int{"/readyz/kms-providers": 200, "/healthz/kms-providers": 200, "/livez/kms-providers": 404} {
		if code, body := get(t, s, path); code != want {
			t.Errorf("GET %s: %d %s, want %d", path, code, body, want)
		}
	}

	// Cluster coordination is on by default, as in the shim: the member key is published
	// under the coordination prefix with kube-apiserver's etcd client flags, and the
	// rekey-cluster check is on /readyz only.
	membersDir := testbed.MembersKey(coordinationPrefix(t), "")
	members, err := cli.Get(ctx, membersDir, clientv3.WithPrefix())
	if err != nil || len(members.Kvs) != 1 || members.Kvs[0].Lease == 0 {
		t.Errorf("member keys under %s: %v %v, want one under a lease", membersDir, err, members)
	} else if id := strings.TrimPrefix(string(members.Kvs[0].Key), membersDir); !strings.HasPrefix(id, "apiserver-") {
		t.Errorf("member id %q, want kube-apiserver's identity apiserver-<hash>", id)
	}
	if code, body := get(t, s, "/readyz?verbose"); code != http.StatusOK || !strings.Contains(body, "[+]"+cluster.ReadyzCheckName+" ok") {
		t.Errorf("/readyz?verbose: %d, want the %s check listed:\n%s", code, cluster.ReadyzCheckName, body)
	}
	if code, _ := get(t, s, "/livez/"+cluster.ReadyzCheckName); code != http.StatusNotFound {
		t.Errorf("/livez/%s: %d, want 404 (readyz only)", cluster.ReadyzCheckName, code)
	}

	// A hot reload while writers run: new Secrets go to aesgcm key2 within moments and
	// no request fails.
	c := clientFor(t, s)
	kubectl("", "create", "namespace", "kapi-writers")
	w := startWriters(t, c, "kapi-writers", 4)
	time.Sleep(time.Second)
	writeConfig(t, config, configOf(append([]string{rule("secrets", aesgcm("key2", key2), kms("local", plugin.Endpoint), identity)}, others...)...))
	eventually(t, 30*time.Second, 50*time.Millisecond, "new Secrets under key2", func() error {
		name := fmt.Sprintf("probe-%d", time.Now().UnixNano())
		if _, err := c.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}}, metav1.CreateOptions{}); err != nil {
			return err
		}
		resp, err := cli.Get(ctx, prefix+"/secrets/"+ns+"/"+name)
		if err != nil || len(resp.Kvs) != 1 {
			return fmt.Errorf("raw read: %v", err)
		}
		if v := resp.Kvs[0].Value; !bytes.HasPrefix(v, []byte("k8s:enc:aesgcm:v1:key2:")) {
			return fmt.Errorf("written as %q…", v[:min(len(v), 24)])
		}
		return nil
	})
	time.Sleep(time.Second)
	ok, fail, errs := w.finish()
	t.Logf("writers during the reload: %d ok, %d failed", ok, fail)
	if fail > 0 {
		t.Errorf("%d failed requests during the reload, e.g. %s", fail, errs[0])
	}
	if ok == 0 {
		t.Error("the writers made no progress")
	}
	if out := kubectl("", "-n", ns, "get", "secret", "db", "-o", "jsonpath={.data.password}"); out != "a2FwaS1wbGFpbnRleHQtMQ==" {
		t.Errorf("Secret written under KMS after the reload: %q", out)
	}

	st, body := statusDoc[reloadStatus](t, s)
	if st.ReloadsSucceeded < 1 || !strings.Contains(fmt.Sprint(st.Resources), "k8s:enc:aesgcm:v1:key2:") {
		t.Errorf("status document after the reload: %s", body)
	}
	if strings.Contains(body, key2) || strings.Contains(body, cmKey) {
		t.Error("the status document holds key material")
	}

	_, metricsText := get(t, s, "/metrics")
	families := metricFamilies(metricsText)
	for name, n := range families {
		if n > 1 {
			t.Errorf("/metrics: %s declared %d times", name, n)
		}
	}
	for _, name := range []string{
		"apiserver_storage_transformation_operations_total",
		"apiserver_storage_transformation_duration_seconds",
		"apiserver_envelope_encryption_kms_operations_latency_seconds",
		"apiserver_encryption_config_controller_automatic_reloads_total",
		"apiserver_request_total", // the rest of kube-apiserver's metrics stay
	} {
		if families[name] != 1 {
			t.Errorf("/metrics: %s declared %d times, want once", name, families[name])
		}
	}
}

// metricFamilies counts the "# TYPE" lines of each family in a Prometheus text page.
func metricFamilies(text string) map[string]int {
	out := map[string]int{}
	sc := bufio.NewScanner(strings.NewReader(text))
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		if f := strings.Fields(sc.Text()); len(f) >= 3 && f[0] == "#" && f[1] == "TYPE" {
			out[f[2]]++
		}
	}
	return out
}

// kube-apiserver with rekey and unmodified upstream kube-apiserver of the same version
// on one etcd prefix, one config and one KMS plugin, automatic reload off: each reads
// what the other wrote; a value under a key that is not the write key is stale for both
// (a no-op update rewrites it under the write key) and a fresh one for neither (a no-op
// update leaves it alone); both serve the same KMS health check.
func TestKubeAPIServerInteropWithUpstream(t *testing.T) {
	bins := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	old, cur := testbed.RandomKey(), testbed.RandomKey()
	oldConfig := filepath.Join(dir, "old.yaml")
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, oldConfig, configOf(rule("secrets", aesgcm("old", old))))
	writeConfig(t, config, configOf(
		rule("secrets", aesgcm("cur", cur), aesgcm("old", old), identity),
		rule("configmaps", kms("local", plugin.Endpoint), identity)))
	saKey := filepath.Join(dir, "sa.key")
	if err := testbed.WriteServiceAccountKey(saKey); err != nil {
		t.Fatal(err)
	}
	prefix := uniquePrefix(t)
	cfg := func(name string) testbed.KubeAPIServerConfig {
		return testbed.KubeAPIServerConfig{Name: name, Dir: filepath.Join(dir, name), EtcdPrefix: prefix,
			ServiceAccountKey: saKey, EncryptionConfig: config}
	}
	ours := startKubeAPIServer(t, bins.Rekey, cfg("kube-apiserver-rekey"))
	theirs := startKubeAPIServer(t, bins.Upstream, cfg("kube-apiserver-upstream"))
	servers := map[string]*testbed.Shim{"rekey": ours, "upstream": theirs}

	ns := "kapi-interop"
	if _, err := ours.Kubectl(ctx, "", "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	raw := func(key string) (string, int64) {
		t.Helper()
		resp, err := cli.Get(ctx, key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("%s: not in etcd: %v", key, err)
		}
		v := resp.Kvs[0].Value
		return string(v[:min(len(v), 22)]), resp.Kvs[0].ModRevision
	}

	// Fresh writes by each, read by the other.
	for writer, reader := range map[string]string{"rekey": "upstream", "upstream": "rekey"} {
		w, r := clientFor(t, servers[writer]), clientFor(t, servers[reader])
		name := "by-" + writer
		if _, err := w.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
			StringData: map[string]string{"v": name}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s creates a Secret: %v", writer, err)
		}
		if _, err := w.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: name},
			Data: map[string]string{"v": name}}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s creates a ConfigMap: %v", writer, err)
		}
		if got, err := r.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || string(got.Data["v"]) != name {
			t.Errorf("%s reads the Secret %s wrote: %v", reader, writer, err)
		}
		if got, err := r.CoreV1().ConfigMaps(ns).Get(ctx, name, metav1.GetOptions{}); err != nil || got.Data["v"] != name {
			t.Errorf("%s reads the ConfigMap %s wrote: %v", reader, writer, err)
		}
		if p, _ := raw(prefix + "/secrets/" + ns + "/" + name); p != "k8s:enc:aesgcm:v1:cur:" {
			t.Errorf("%s wrote a Secret as %q", writer, p)
		}
		if p, _ := raw(prefix + "/configmaps/" + ns + "/" + name); !strings.HasPrefix(p, "k8s:enc:kms:v2:local:") {
			t.Errorf("%s wrote a ConfigMap as %q", writer, p)
		}
	}

	// Values under the old key, written as an apiserver on the old config would have.
	oldT, err := testbed.Upstream(ctx, oldConfig)
	if err != nil {
		t.Fatal(err)
	}
	for _, name := range []string{"old-for-rekey", "old-for-upstream"} {
		err := testbed.WriteStored(ctx, cli, oldT, corev1.Resource("secrets"), prefix+"/secrets/"+ns+"/"+name, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID("uid-" + name), CreationTimestamp: metav1.Now()},
			Type:       corev1.SecretTypeOpaque, Data: map[string][]byte{"v": []byte(name)}})
		if err != nil {
			t.Fatal(err)
		}
	}
	// A no-op update rewrites a value only when the read said stale.
	for _, c := range []struct {
		server, name string
		stale        bool
	}{
		{"rekey", "old-for-rekey", true},
		{"upstream", "old-for-upstream", true},
		{"rekey", "by-upstream", false},
		{"upstream", "by-rekey", false},
	} {
		key := prefix + "/secrets/" + ns + "/" + c.name
		_, before := raw(key)
		sc := clientFor(t, servers[c.server]).CoreV1().Secrets(ns)
		obj, err := sc.Get(ctx, c.name, metav1.GetOptions{})
		if err != nil {
			t.Fatalf("%s reads %s: %v", c.server, c.name, err)
		}
		if _, err := sc.Update(ctx, obj, metav1.UpdateOptions{}); err != nil {
			t.Fatalf("%s updates %s: %v", c.server, c.name, err)
		}
		p, after := raw(key)
		if rewritten := after != before; rewritten != c.stale {
			t.Errorf("%s, no-op update of %s: rewritten=%v, want %v (stale)", c.server, c.name, rewritten, c.stale)
		}
		if p != "k8s:enc:aesgcm:v1:cur:" {
			t.Errorf("%s after the no-op update through %s: %q", c.name, c.server, p)
		}
	}

	// Reload off with KMS v2 only: both serve the same KMS check (upstream names checks
	// per provider, kms-provider-<i>, only when a KMS v1 provider is configured).
	checks := map[string][]string{}
	for name, s := range servers {
		code, body := get(t, s, "/readyz?verbose")
		if code != http.StatusOK {
			t.Fatalf("%s /readyz: %d\n%s", name, code, body)
		}
		for _, line := range strings.Split(body, "\n") {
			if strings.Contains(line, "kms-provider") {
				checks[name] = append(checks[name], strings.TrimSpace(line))
			}
		}
	}
	if !slices.Equal(checks["rekey"], checks["upstream"]) || len(checks["rekey"]) != 1 {
		t.Errorf("kms checks on /readyz: rekey %v, upstream %v", checks["rekey"], checks["upstream"])
	}
}

// --version names the upstream version and rekey; a KMS v1 provider in the write
// position is refused with an error that says how to keep it readable and does not send
// the operator to the KMSv1 feature gate.
func TestKubeAPIServerVersionAndKMSv1(t *testing.T) {
	bins := kubeAPIServers(t)
	out, err := exec.CommandContext(t.Context(), bins.Rekey, "--version").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Kubernetes v1.37.2") || !strings.Contains(string(out), "rekey") {
		t.Errorf("--version: %q %v", out, err)
	}

	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, configOf(rule("secrets", "  - kms:\n      name: v1plugin\n      endpoint: unix:///tmp/none.sock\n")))
	port, err := testbed.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	args, err := testbed.KubeAPIServerArgs(testbed.KubeAPIServerConfig{Dir: dir, EtcdServers: []string{etcd.Endpoint},
		EtcdPrefix: uniquePrefix(t), EncryptionConfig: config}, port)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 2*time.Minute)
	defer cancel()
	out, err = exec.CommandContext(ctx, bins.Rekey, append(args, "--feature-gates=KMSv1=true")...).CombinedOutput()
	if err == nil {
		t.Fatal("started with a KMS v1 provider")
	}
	if !strings.Contains(string(out), "KMS v1 can only be read") || strings.Contains(string(out), "--feature-gates=KMSv1=true to use") {
		t.Errorf("KMS v1 error: %s", tail(string(out), 2000))
	}
}

func tail(s string, n int) string { return s[max(0, len(s)-n):] }
