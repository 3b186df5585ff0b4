package main

import (
	"context"
	"os"
	"path/filepath"
	"strings"
	"testing"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/shimtest"
	"github.com/rekey-io/rekey/pkg/config"
)

// The configuration kept in a Secret (as hosted control planes keep it): rotate edits
// the Secret's key through the API and keeps its other keys, and the commands that
// read stored data read the configuration from it.
func TestRotateEditsAConfigurationKeptInASecret(t *testing.T) {
	api := shimtest.Start(t)
	ctx := context.Background()
	path := writeConfig(t, "enc.yaml", "key1")
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	secrets := api.Client.CoreV1().Secrets("default")
	if _, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kas-encryption"},
		Data: map[string][]byte{"config.yaml": data, "other": []byte("kept")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	src := []string{"--secret", "default/kas-encryption:config.yaml", "--kubeconfig", api.Kubeconfig}

	out, err := run(t, append([]string{"rotate"}, src...)...)
	if err != nil {
		t.Fatalf("rotate --secret: %v\n%s", err, out)
	}
	if !strings.HasPrefix(out, "secret default/kas-encryption key config.yaml: ") {
		t.Fatalf("rotate --secret printed %q, want it to name the Secret's key", out)
	}
	sec, err := secrets.Get(ctx, "kas-encryption", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Parse(sec.Data["config.yaml"], "the Secret", config.Options{Reload: true})
	if err != nil {
		t.Fatalf("the Secret holds no valid configuration after rotate: %v", err)
	}
	keys := cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys
	if len(keys) != 2 || keys[1].Name != "key1" || string(sec.Data["other"]) != "kept" {
		t.Fatalf("after rotate the Secret's aesgcm keys are %v and its other key %q; want a new key before key1, and the other key kept", keys, sec.Data["other"])
	}

	// A command that reads stored data takes its keys from the Secret too.
	srv := etcdtest.Start(t)
	seed(t, srv.Client(t), path, 5)
	out, err = run(t, append([]string{"inventory", "--etcd-servers", srv.Endpoint}, src...)...)
	if err != nil || !strings.Contains(out, "key1") {
		t.Fatalf("inventory --secret: %v\n%s", err, out)
	}

	if _, err := run(t, "rotate", "--secret", "default/kas-encryption", "--encryption-provider-config", path); err == nil ||
		!strings.Contains(err.Error(), "--encryption-provider-config and --secret both name the configuration") {
		t.Fatalf("rotate with a file and a Secret: %v", err)
	}
	if _, err := run(t, "rotate"); err == nil || !strings.Contains(err.Error(), "--encryption-provider-config (a file) or --secret") {
		t.Fatalf("rotate without a source: %v", err)
	}
}

// A Secret's source is built once per command: rotate --wait reads the configuration
// every --wait-interval, and each build loaded the kubeconfig and made a clientset.
// The second call must not read the kubeconfig again (it is gone by then).
func TestSecretSourceIsBuiltOnce(t *testing.T) {
	kubeconfig := filepath.Join(t.TempDir(), "kubeconfig")
	if err := os.WriteFile(kubeconfig, []byte(`apiVersion: v1
kind: Config
clusters: [{name: c, cluster: {server: "https://127.0.0.1:1"}}]
users: [{name: u, user: {token: t}}]
contexts: [{name: x, context: {cluster: c, user: u}}]
current-context: x
`), 0o600); err != nil {
		t.Fatal(err)
	}
	f := sourceFlags{secret: "kube-system/encryption:config.yaml", kubeconfig: kubeconfig}
	first, err := f.source()
	if err != nil {
		t.Fatal(err)
	}
	if err := os.Remove(kubeconfig); err != nil {
		t.Fatal(err)
	}
	second, err := f.source()
	if err != nil {
		t.Fatalf("the second use built the source again: %v", err)
	}
	if first != second {
		t.Fatalf("the second use returned another source: %v, then %v", first, second)
	}
	fresh := sourceFlags{secret: f.secret, kubeconfig: kubeconfig}
	if _, err := fresh.source(); err == nil {
		t.Fatal("a source built from a kubeconfig that is gone: want an error")
	}
}
