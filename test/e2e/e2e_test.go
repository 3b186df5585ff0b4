package e2e

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

// kubectl create/get/apply/patch/delete against the shim process on an etcd process;
// the stored bytes carry kube-apiserver's prefixes, hold no plaintext, decrypt with
// k8s.io/apiserver's own transformers, and a value upstream's transformers wrote reads
// back through the shim.
func TestKubectlAgainstEncryptedEtcd(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig(
		[]string{aesgcm("key1", testbed.RandomKey()), identity},
		[]string{aescbc("cbc1", testbed.RandomKey()), identity}))
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config})

	ns := "kubectl-e2e"
	for _, args := range [][]string{
		{"-n", ns, "create", "secret", "generic", "db", "--from-literal=password=kubectl-plaintext-1"},
		{"-n", ns, "create", "configmap", "settings", "--from-literal=mode=kubectl-plaintext-2"},
		{"-n", ns, "patch", "cm", "settings", "-p", `{"data":{"extra":"1"}}`},
	} {
		if _, err := s.Kubectl(ctx, "", args...); err != nil {
			t.Fatal(err)
		}
	}
	applied := `{"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"ssa","namespace":"` + ns + `"},"data":{"k":"v"}}`
	if _, err := s.Kubectl(ctx, applied, "apply", "--server-side", "-f", "-"); err != nil {
		t.Fatal(err)
	}
	out, err := s.Kubectl(ctx, "", "-n", ns, "get", "secrets")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "NAME") || !strings.Contains(out, "TYPE") || !strings.Contains(out, "db") || !strings.Contains(out, "Opaque") {
		t.Fatalf("kubectl get secrets:\n%s", out)
	}
	out, err = s.Kubectl(ctx, "", "-n", ns, "get", "cm")
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "DATA") || !strings.Contains(out, "settings") || !strings.Contains(out, "ssa") {
		t.Fatalf("kubectl get cm:\n%s", out)
	}
	out, err = s.Kubectl(ctx, "", "-n", ns, "get", "secret", "db", "-o", "jsonpath={.data.password}")
	if err != nil || out != "a3ViZWN0bC1wbGFpbnRleHQtMQ==" {
		t.Fatalf("kubectl get secret -o jsonpath: %q %v", out, err)
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
		gr        string
		key       string
		prefix    string
		plaintext string
	}{
		{"secrets", "/registry/secrets/" + ns + "/db", "k8s:enc:aesgcm:v1:key1:", "kubectl-plaintext-1"},
		{"configmaps", "/registry/configmaps/" + ns + "/settings", "k8s:enc:aescbc:v1:cbc1:", "kubectl-plaintext-2"},
	} {
		raw, obj, err := testbed.ReadStored(ctx, cli, up, corev1.Resource(c.gr), c.key)
		if err != nil {
			t.Fatalf("%s: %v", c.key, err)
		}
		if !bytes.HasPrefix(raw, []byte(c.prefix)) {
			t.Errorf("%s: stored prefix %q, want %q", c.key, raw[:min(len(raw), len(c.prefix))], c.prefix)
		}
		if bytes.Contains(raw, []byte(c.plaintext)) {
			t.Errorf("%s: plaintext stored in etcd", c.key)
		}
		if !strings.Contains(values(obj), c.plaintext) {
			t.Errorf("%s: upstream decrypted %v", c.key, obj)
		}
	}

	// The other direction: kube-apiserver's transformers write, the shim reads.
	key := "/registry/secrets/" + ns + "/from-upstream"
	err = testbed.WriteStored(ctx, cli, up, corev1.Resource("secrets"), key, &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "from-upstream", Namespace: ns, UID: "u-1", CreationTimestamp: metav1.Now()},
		Type:       corev1.SecretTypeOpaque,
		Data:       map[string][]byte{"token": []byte("written-by-upstream")},
	})
	if err != nil {
		t.Fatal(err)
	}
	out, err = s.Kubectl(ctx, "", "-n", ns, "get", "secret", "from-upstream", "-o", "jsonpath={.data.token}")
	if err != nil || out != "d3JpdHRlbi1ieS11cHN0cmVhbQ==" {
		t.Fatalf("shim read of an upstream-written value: %q %v", out, err)
	}
	if _, err := s.Kubectl(ctx, "", "-n", ns, "delete", "secret", "db", "from-upstream"); err != nil {
		t.Fatal(err)
	}
}

// Two shims on one etcd and one config, one with rekey's layer and one with
// k8s.io/apiserver's encryptionconfig (as kube-apiserver runs it), KMS v2 on the same
// plugin: each reads what the other wrote.
func TestInteropWithUpstreamLayer(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig(
		[]string{kms("local", plugin.Endpoint), identity},
		[]string{aesgcm("key1", testbed.RandomKey())}))
	ours := startShim(t, testbed.ShimConfig{Name: "shim-rekey", Dir: filepath.Join(dir, "rekey"), EncryptionConfig: config})
	var upstreamEnv []string
	if testbed.FIPS() {
		// Upstream's layer cannot run under fips140=only (its aesgcm and KMS v2 use
		// cipher.NewGCM): the reference shim runs outside FIPS mode, rekey's in it.
		upstreamEnv = []string{"GODEBUG=fips140=off"}
	}
	theirs := startShim(t, testbed.ShimConfig{Name: "shim-upstream", Dir: filepath.Join(dir, "upstream"), EncryptionConfig: config, Layer: "upstream", Env: upstreamEnv})
	oc, uc := clientFor(t, ours), clientFor(t, theirs)

	ns := "interop-e2e"
	for i, pair := range []struct {
		name         string
		writer, read string
	}{{"by-rekey", "rekey", "upstream"}, {"by-upstream", "upstream", "rekey"}} {
		w, r := oc, uc
		if i == 1 {
			w, r = uc, oc
		}
		if _, err := w.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: pair.name}, StringData: map[string]string{"v": pair.name},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s create: %v", pair.writer, err)
		}
		if _, err := w.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{
			ObjectMeta: metav1.ObjectMeta{Name: pair.name}, Data: map[string]string{"v": pair.name},
		}, metav1.CreateOptions{}); err != nil {
			t.Fatalf("%s create cm: %v", pair.writer, err)
		}
		got, err := r.CoreV1().Secrets(ns).Get(ctx, pair.name, metav1.GetOptions{})
		if err != nil || string(got.Data["v"]) != pair.name {
			t.Fatalf("%s reading a secret %s wrote: %v %v", pair.read, pair.writer, err, got)
		}
		cm, err := r.CoreV1().ConfigMaps(ns).Get(ctx, pair.name, metav1.GetOptions{})
		if err != nil || cm.Data["v"] != pair.name {
			t.Fatalf("%s reading a configmap %s wrote: %v %v", pair.read, pair.writer, err, cm)
		}
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	for _, name := range []string{"by-rekey", "by-upstream"} {
		resp, err := cli.Get(ctx, "/registry/secrets/"+ns+"/"+name)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("raw read: %v", err)
		}
		if v := resp.Kvs[0].Value; !bytes.HasPrefix(v, []byte("k8s:enc:kms:v2:local:")) || bytes.Contains(v, []byte(name)) {
			t.Errorf("%s stored as %q…", name, v[:min(len(v), 24)])
		}
	}
}

// Start-up failures say what is wrong and exit non-zero.
func TestStartupErrors(t *testing.T) {
	dir := t.TempDir()
	unreadable := filepath.Join(dir, "unreadable.yaml")
	writeConfig(t, unreadable, encryptionConfig([]string{identity}, []string{identity}))
	if err := os.Chmod(unreadable, 0); err != nil {
		t.Fatal(err)
	}
	invalid := filepath.Join(dir, "invalid.yaml")
	writeConfig(t, invalid, encryptionConfig([]string{aesgcm("k", "dG9vLXNob3J0")}, []string{identity}))
	closedPort, err := testbed.FreePort()
	if err != nil {
		t.Fatal(err)
	}
	cases := []struct {
		name string
		cfg  testbed.ShimConfig
		want []string
	}{
		{"missing config", testbed.ShimConfig{EncryptionConfig: filepath.Join(dir, "nope.yaml"), EtcdServers: []string{etcd.Endpoint}},
			[]string{"--encryption-provider-config", "nope.yaml", "no such file"}},
		{"invalid config", testbed.ShimConfig{EncryptionConfig: invalid, EtcdServers: []string{etcd.Endpoint}},
			[]string{"invalid.yaml", "aesgcm"}},
		{"unreachable etcd", testbed.ShimConfig{EtcdServers: []string{fmt.Sprintf("http://127.0.0.1:%d", closedPort)},
			Args: []string{"--etcd-connect-timeout", "1s"}},
			[]string{"cannot reach etcd", fmt.Sprint(closedPort), "--etcd-servers"}},
	}
	if os.Geteuid() != 0 { // root reads mode-000 files
		cases = append(cases, struct {
			name string
			cfg  testbed.ShimConfig
			want []string
		}{"unreadable config", testbed.ShimConfig{EncryptionConfig: unreadable, EtcdServers: []string{etcd.Endpoint}},
			[]string{"unreadable.yaml", "permission denied"}})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			c.cfg.Dir = t.TempDir()
			args, err := testbed.ShimArgs(c.cfg)
			if err != nil {
				t.Fatal(err)
			}
			p, err := testbed.Start("shim", c.cfg.Dir, bins.Shim, args...)
			if err != nil {
				t.Fatal(err)
			}
			log := refusedToStart(t, p, 30*time.Second, "", 4000)
			for _, w := range c.want {
				if !strings.Contains(log, w) {
					t.Errorf("error output lacks %q:\n%s", w, log)
				}
			}
		})
	}
}

// A KMS plugin socket that does not exist yet: the shim starts, reports not ready
// with the kms-providers check failing, and recovers once the plugin appears.
func TestMissingPluginSocketRecovers(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	sockDir := shortTempDir(t)
	endpoint := "unix://" + testbed.PluginSocket(sockDir)
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig([]string{kms("late", endpoint)}, []string{identity}))

	args, err := testbed.ShimArgs(testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdServers: []string{etcd.Endpoint},
		Args: []string{"--kms-retry-interval", "500ms", "--kms-status-interval", "2s"}})
	if err != nil {
		t.Fatal(err)
	}
	p, err := testbed.Start("shim", dir, bins.Shim, args...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(15 * time.Second) })
	s := &testbed.Shim{Process: p, CAFile: filepath.Join(dir, "certs", "apiserver.crt")}
	var port string
	eventually(t, 30*time.Second, 20*time.Millisecond, "port file", func() error {
		b, err := os.ReadFile(filepath.Join(dir, "port"))
		port = strings.TrimSpace(string(b))
		if err == nil && port == "" {
			err = fmt.Errorf("empty")
		}
		return err
	})
	s.URL = "https://127.0.0.1:" + port
	hc, err := s.HTTPClient(false)
	if err != nil {
		t.Fatal(err)
	}
	readyz := func() (int, string) {
		resp, err := hc.Get(s.URL + "/readyz?verbose")
		if err != nil {
			return 0, err.Error()
		}
		defer resp.Body.Close()
		b, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, string(b)
	}
	eventually(t, 20*time.Second, 100*time.Millisecond, "readyz reporting the missing plugin", func() error {
		code, body := readyz()
		if code == 500 && strings.Contains(body, "[-]kms-providers failed") {
			return nil
		}
		return fmt.Errorf("%d %s", code, body)
	})
	select {
	case <-p.Done():
		t.Fatalf("shim exited without its plugin: %s", p.Log(2000))
	default:
	}

	pl, err := testbed.StartPlugin(ctx, bins.Plugin, dir, sockDir, testbed.PluginKey{Name: "kek-1", Secret: testbed.RandomKey()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { pl.Stop(5 * time.Second) })
	eventually(t, 20*time.Second, 100*time.Millisecond, "readyz after the plugin appeared", func() error {
		if code, body := readyz(); code != 200 {
			return fmt.Errorf("%d %s", code, body)
		}
		return nil
	})
	s.Token = "testbed-admin-token"
	c := clientFor(t, s)
	if _, err := c.CoreV1().Secrets("late-plugin").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("write after recovery: %v", err)
	}
}

// The KMS plugin process dies: reads keep working (cached DEKs), writes keep working
// for the grace window (--kms-write-ttl) and then fail with an error naming the
// plugin; a restarted plugin restores writes.
func TestPluginOutage(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig([]string{kms("outage", plugin.Endpoint)}, []string{identity}))
	const grace = 6 * time.Second
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config,
		Args: []string{"--kms-write-ttl", grace.String(), "--kms-status-interval", "1s", "--kms-retry-interval", "500ms"}})
	secrets := clientFor(t, s).CoreV1().Secrets("outage")
	create := func(name string) error {
		_, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
			StringData: map[string]string{"v": name}}, metav1.CreateOptions{})
		return err
	}
	if err := create("before"); err != nil {
		t.Fatal(err)
	}
	plugin.Kill()
	killedAt := time.Now()
	if err := create("during-grace"); err != nil {
		t.Fatalf("write within the grace window failed: %v", err)
	}
	for _, name := range []string{"before", "during-grace"} {
		if got, err := secrets.Get(ctx, name, metav1.GetOptions{}); err != nil || string(got.Data["v"]) != name {
			t.Fatalf("read during outage: %v", err)
		}
	}
	var writeErr error
	eventually(t, grace+15*time.Second, 250*time.Millisecond, "writes failing after the grace window", func() error {
		writeErr = create(fmt.Sprintf("w-%d", time.Now().UnixNano()))
		if writeErr == nil {
			return fmt.Errorf("write still succeeds %v after the plugin died", time.Since(killedAt).Round(time.Millisecond))
		}
		return nil
	})
	if failedAfter := time.Since(killedAt); failedAfter < grace-time.Second {
		t.Errorf("writes failed %v after the outage, before the %v grace window", failedAfter, grace)
	}
	if !strings.Contains(writeErr.Error(), "outage") || !strings.Contains(strings.ToLower(writeErr.Error()), "plugin") {
		t.Errorf("write error does not name the provider and the plugin: %v", writeErr)
	}
	t.Logf("write error after grace: %v", writeErr)
	if got, err := secrets.Get(ctx, "before", metav1.GetOptions{}); err != nil || string(got.Data["v"]) != "before" {
		t.Fatalf("read after grace: %v", err)
	}

	restarted, err := testbed.StartPlugin(ctx, bins.Plugin, dir, filepath.Dir(plugin.Socket))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { restarted.Stop(5 * time.Second) })
	eventually(t, 20*time.Second, 250*time.Millisecond, "writes after the plugin restarted", func() error {
		return create(fmt.Sprintf("after-%d", time.Now().UnixNano()))
	})
}

// One command, embedded etcd: time to ready and idle memory.
func TestEmbeddedEtcdReadyAndIdleRSS(t *testing.T) {
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", testbed.RandomKey())}, []string{identity}))
	if testbed.FIPS() {
		// Under GODEBUG=fips140=only etcd cannot run inside the shim (SHA-1 member
		// ids): the shim says so and exits, instead of etcd's panic.
		args, err := testbed.ShimArgs(testbed.ShimConfig{Dir: dir, EncryptionConfig: config})
		if err != nil {
			t.Fatal(err)
		}
		p, err := testbed.Start("shim", dir, bins.Shim, args...)
		if err != nil {
			t.Fatal(err)
		}
		log := refusedToStart(t, p, 60*time.Second, "with embedded etcd under fips140=only", 8000)
		if !strings.Contains(log, "embedded etcd cannot run in FIPS 140-3 mode enforced") || !strings.Contains(log, "--etcd-servers") || strings.Contains(log, "panic") {
			t.Fatalf("want the embedded etcd refused in FIPS mode; log:\n%s", log)
		}
		return
	}
	s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdServers: []string{}})
	t.Logf("embedded etcd: ready %v after start (target < 2s)", s.Ready.Round(time.Millisecond))
	if s.Ready > 10*time.Second {
		t.Errorf("ready after %v", s.Ready)
	}
	c := clientFor(t, s)
	for i := range 20 {
		if _, err := c.CoreV1().Secrets("rss").Create(t.Context(), &corev1.Secret{
			ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%d", i)}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	time.Sleep(3 * time.Second)
	rss, err := testbed.RSS(s.PID())
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("idle RSS (shim + embedded etcd, one process): %.1f MiB", float64(rss)/(1<<20))
}

// values joins the data values of a Secret or ConfigMap.
func values(obj any) string {
	var out []string
	switch o := obj.(type) {
	case *corev1.Secret:
		for _, v := range o.Data {
			out = append(out, string(v))
		}
	case *corev1.ConfigMap:
		for _, v := range o.Data {
			out = append(out, v)
		}
	}
	return strings.Join(out, ",")
}

// refusedToStart waits up to timeout for p, started with what it must refuse (what
// says it in a failure: "with …"), to exit, and returns the last logBytes of its log.
// The test fails when it is still running then or exited 0.
func refusedToStart(t *testing.T, p *testbed.Process, timeout time.Duration, what string, logBytes int) string {
	t.Helper()
	if what != "" {
		what = " " + what
	}
	select {
	case <-p.Done():
	case <-time.After(timeout):
		p.Kill()
		t.Fatalf("still running%s after %v; log:\n%s", what, timeout, p.Log(logBytes))
	}
	if p.ExitErr() == nil {
		t.Fatalf("exit status 0%s; log:\n%s", what, p.Log(logBytes))
	}
	return p.Log(logBytes)
}
