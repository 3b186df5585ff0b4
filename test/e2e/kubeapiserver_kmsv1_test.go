package e2e

import (
	"bytes"
	"fmt"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

// kmsV1 renders a KMS v1 provider entry.
func kmsV1(name, endpoint string) string {
	return fmt.Sprintf("  - kms:\n      apiVersion: v1\n      name: %s\n      endpoint: %s\n      timeout: 2s\n", name, endpoint)
}

// A cluster whose Secrets upstream kube-apiserver wrote with KMS v1 (its KMSv1 gate on)
// adopts kube-apiserver with rekey: with a KMS v2 provider first and the v1 provider
// behind it, every Secret reads from the first request on — no read fails while the
// storage migration moves them — and the migration leaves every value under KMS v2.
func TestKubeAPIServerAdoptsKMSv1Data(t *testing.T) {
	const secrets = 40
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	v1, err := testbed.StartPluginV1(ctx, bins.Plugin, t.TempDir(), shortTempDir(t), testbed.PluginKey{Name: "kek-v1", Secret: testbed.RandomKey()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { v1.Stop(5 * time.Second) })
	v2 := startPlugin(t, t.TempDir())
	saKey := filepath.Join(dir, "sa.key")
	if err := testbed.WriteServiceAccountKey(saKey); err != nil {
		t.Fatal(err)
	}
	prefix := uniquePrefix(t)

	old := filepath.Join(dir, "v1.yaml")
	writeConfig(t, old, configOf(rule("secrets", kmsV1("legacy", v1.Endpoint), identity)))
	theirs := startKubeAPIServer(t, kapi.Upstream, testbed.KubeAPIServerConfig{Name: "kapi-upstream-v1", Dir: filepath.Join(dir, "theirs"),
		EtcdPrefix: prefix, ServiceAccountKey: saKey, EncryptionConfig: old, Args: []string{"--feature-gates", "KMSv1=true"}})
	ns := "kapi-kmsv1"
	if _, err := theirs.Kubectl(ctx, "", "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	up := clientFor(t, theirs)
	for i := range secrets {
		if _, err := up.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%02d", i)},
			StringData: map[string]string{"v": fmt.Sprintf("value-%02d", i)}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	underPrefix := func(stored string) (n, total int) {
		t.Helper()
		resp, err := cli.Get(ctx, prefix+"/secrets/"+ns+"/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		for _, kv := range resp.Kvs {
			if bytes.HasPrefix(kv.Value, []byte(stored)) {
				n++
			}
		}
		return n, len(resp.Kvs)
	}
	if n, total := underPrefix("k8s:enc:kms:v1:legacy:"); n != secrets || total != secrets {
		t.Fatalf("upstream stored %d of %d Secrets under KMS v1, want %d", n, total, secrets)
	}
	theirs.Stop(30 * time.Second)

	adopt := filepath.Join(dir, "adopt.yaml")
	writeConfig(t, adopt, configOf(rule("secrets", kms("current", v2.Endpoint), kmsV1("legacy", v1.Endpoint), identity)))
	ours := startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: "kapi-rekey-adopts", Dir: filepath.Join(dir, "ours"),
		EtcdPrefix: prefix, ServiceAccountKey: saKey, EncryptionConfig: adopt,
		Args: []string{"--storage-migration-check-interval", "1s"}})
	// Read every Secret in a loop from the first moment on, until the migration is done.
	c := clientFor(t, ours)
	var reads, failed atomic.Int64
	stop := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-stop:
				return
			default:
			}
			for i := range secrets {
				s, err := c.CoreV1().Secrets(ns).Get(ctx, fmt.Sprintf("s%02d", i), metav1.GetOptions{})
				reads.Add(1)
				if err != nil || string(s.Data["v"]) != fmt.Sprintf("value-%02d", i) {
					failed.Add(1)
					t.Errorf("reading s%02d during the adoption: %v", i, err)
				}
			}
		}
	}()
	eventually(t, 60*time.Second, 500*time.Millisecond, "every Secret moved to KMS v2", func() error {
		if n, total := underPrefix("k8s:enc:kms:v2:current:"); n != total {
			return fmt.Errorf("%d of %d under KMS v2", n, total)
		}
		return nil
	})
	close(stop)
	wg.Wait()
	t.Logf("%d reads during the adoption, %d failed", reads.Load(), failed.Load())
	if reads.Load() < secrets {
		t.Errorf("only %d reads ran during the adoption", reads.Load())
	}
}
