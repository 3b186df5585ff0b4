package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// runKubeAPIServer runs bin/kube-apiserver (dist/kube-apiserver) twice on one etcd
// process, each under its own etcd prefix — once with rekey's layer, once with
// upstream's (--encryption-layer=upstream, the same binary and flags otherwise) — both
// encrypting Secrets with KMS v2 through one local plugin, and drives the e2e
// scenario's create+get load against both.
func runKubeAPIServer(s Settings) ([]Row, error) {
	if s.Short {
		// Building k8s.io/kubernetes alone takes longer than a short run may.
		if s.Progress != nil {
			fmt.Fprintln(s.Progress, "kube-apiserver: skipped in short mode")
		}
		return nil, nil
	}
	ctx := context.Background()
	dir, err := os.MkdirTemp("", "rkk")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	if s.Progress != nil {
		fmt.Fprintln(s.Progress, "kube-apiserver: building etcd, the plugin and dist/kube-apiserver (the first build compiles k8s.io/kubernetes)")
	}
	bins, err := testbed.Build(ctx, filepath.Join(dir, "bin"))
	if err != nil {
		return nil, err
	}
	kapi, err := testbed.BuildKubeAPIServer(ctx, filepath.Join(dir, "bin"), false)
	if err != nil {
		return nil, err
	}
	etcd, err := testbed.StartEtcd(ctx, bins.Etcd, dir)
	if err != nil {
		return nil, err
	}
	defer etcd.Stop(10 * time.Second)
	plugin, err := testbed.StartPlugin(ctx, bins.Plugin, dir, dir, testbed.PluginKey{Name: "bench-key", Secret: testbed.RandomKey()})
	if err != nil {
		return nil, err
	}
	defer plugin.Stop(5 * time.Second)
	configPath := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(configPath, []byte(fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
  - resources: [secrets]
    providers:
      - kms:
          apiVersion: v2
          name: bench
          endpoint: %s
          timeout: 3s
      - identity: {}
`, plugin.Endpoint)), 0o600); err != nil {
		return nil, err
	}
	servers := map[string]*testbed.Shim{}
	for _, layer := range []string{"rekey", "upstream"} {
		sv, err := testbed.StartKubeAPIServer(ctx, kapi.Rekey, testbed.KubeAPIServerConfig{
			Name: "kube-apiserver-" + layer, Dir: filepath.Join(dir, layer),
			EtcdServers: []string{etcd.Endpoint}, EtcdPrefix: "/" + layer,
			EncryptionConfig: configPath, AutomaticReload: true,
			Args: []string{"--encryption-layer", layer},
		})
		if err != nil {
			return nil, err
		}
		defer sv.Stop(30 * time.Second)
		servers[layer] = sv
	}
	return measureLayers(ctx, s, layerBench{
		scenario:  "kube-apiserver (bin/kube-apiserver on an etcd process, Secrets with KMS v2)",
		readyCase: "start → /readyz (fresh etcd prefix and cert)",
		readyGoal: 30 * time.Second,
		rssCase:   "RSS after the load (kube-apiserver alone)",
		servers:   servers,
		prepare: func(ctx context.Context, c *kubernetes.Clientset, ns string) error {
			_, err := c.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
			if apierrors.IsAlreadyExists(err) {
				return nil
			}
			return err
		},
	})
}
