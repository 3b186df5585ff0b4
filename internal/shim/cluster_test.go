package shim_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/layer"
)

// TestClusterCoordination runs a second shim with --cluster-coordination on the shared
// etcd (its own resource and coordination prefixes): it publishes itself as a member
// under a lease, serves the cluster section and the rekey-cluster readyz check, shows
// the verdict, and deletes its member key when it stops.
func TestClusterCoordination(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(path, fmt.Appendf(nil, encryptionConfig, testbed.RandomKey(), testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	const prefix = "/rekey-cluster-test"
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	go func() {
		done <- shim.Run(ctx, shim.Options{
			EncryptionConfig: path, AutomaticReload: true,
			Rekey: layer.Flags{StorageMigration: true,
				ClusterCoordination: true, CoordinationPrefix: prefix, APIServerID: "shim-c1", ClusterLeaseTTL: 2 * time.Second},
			EtcdServers: info.EtcdServers, EtcdPrefix: "/cluster-test-registry",
			CertDir:         filepath.Join(dir, "certs"),
			Tokens:          map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
			MetricsRegistry: metrics.NewKubeRegistry(),
			Started:         func(i shim.Info) { started <- i },
		})
	}()
	var ci shim.Info
	select {
	case ci = <-started:
	case err := <-done:
		t.Fatalf("clustered shim did not start: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("clustered shim did not start within 60s")
	}
	stopped := false
	stop := func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	defer stop()

	tr, err := rest.TransportFor(&rest.Config{BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: ci.CAFile}})
	if err != nil {
		t.Fatal(err)
	}
	hc := &http.Client{Transport: tr, Timeout: 10 * time.Second}
	get := func(p string) (int, []byte) {
		resp, err := hc.Get(ci.URL + p)
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, _ := io.ReadAll(resp.Body)
		return resp.StatusCode, body
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		code, body := get("/readyz/" + cluster.ReadyzCheckName)
		if code == http.StatusOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("/readyz/%s: %d %s", cluster.ReadyzCheckName, code, body)
		}
		time.Sleep(50 * time.Millisecond)
	}
	if code, _ := get("/livez/" + cluster.ReadyzCheckName); code != http.StatusNotFound {
		t.Errorf("the cluster check is on /livez (%d); it belongs on /readyz only", code)
	}

	var doc struct {
		Cluster *cluster.Status `json:"cluster"`
	}
	for {
		_, body := get(ci.StatusPath)
		if err := json.Unmarshal(body, &doc); err != nil {
			t.Fatal(err)
		}
		if doc.Cluster != nil && len(doc.Cluster.Members) == 1 && doc.Cluster.Verdict.Converged {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("cluster section never showed one converged member: %s", body)
		}
		time.Sleep(100 * time.Millisecond)
	}
	if m := doc.Cluster.Members[0]; m.APIServerID != "shim-c1" || len(m.Resources) != 2 || m.Resources[0].Write.Key != "key1" {
		t.Fatalf("member state: %+v", m)
	}
	for _, name := range []string{"rekey_cluster_members 1", "rekey_cluster_converged 1", "rekey_cluster_migration_leader 1"} {
		for {
			_, m := get("/metrics")
			if strings.Contains(string(m), name) {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("/metrics lacks %q", name)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}

	cli, err := clientv3.New(clientv3.Config{Endpoints: info.EtcdServers, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(context.Background(), coordination.Member(prefix, "shim-c1"))
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("member key: %v %v", resp, err)
	}
	stop()
	resp, err = cli.Get(context.Background(), coordination.Member(prefix, "shim-c1"))
	if err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("member key after a clean shutdown: %v %v; want it deleted", resp.Kvs, err)
	}
}

// TestClusterCoordinationPrefixMustBeOutsideResources: a coordination prefix inside the
// resource prefix is refused before anything starts.
func TestClusterCoordinationPrefixMustBeOutsideResources(t *testing.T) {
	err := shim.Run(context.Background(), shim.Options{
		EncryptionConfig: configPath, Rekey: layer.Flags{ClusterCoordination: true, CoordinationPrefix: "/registry/rekey"},
		EtcdServers: info.EtcdServers, CertDir: t.TempDir(),
		Tokens: map[string]*user.DefaultInfo{token: {Name: "admin"}},
	})
	if err == nil || !strings.Contains(err.Error(), "outside the resource prefix") {
		t.Fatalf("Run = %v, want a refusal of the prefix", err)
	}
}

// stragglerConfig encrypts secrets with one aesgcm key, named and made by the caller.
const stragglerConfig = `apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - aesgcm:
      keys: [{name: %s, secret: %q}]
`

// TestStragglerRefusesWritesWith503: shims a and b write secrets with k2; c starts with
// a file that only has k1, which nobody else can read, so its write fence refuses every
// write of secrets. A client of c sees 503 ServiceUnavailable naming the key c lacks,
// on create and on update (not the 500 of the etcd3 store's wrapping); reads and
// deletes go on, and a and b keep writing.
func TestStragglerRefusesWritesWith503(t *testing.T) {
	dir := t.TempDir()
	newPath, oldPath := filepath.Join(dir, "k2.yaml"), filepath.Join(dir, "k1.yaml")
	if err := os.WriteFile(newPath, fmt.Appendf(nil, stragglerConfig, "k2", testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(oldPath, fmt.Appendf(nil, stragglerConfig, "k1", testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	const etcdPrefix = "/straggler-registry"
	start := func(id, path string) (*kubernetes.Clientset, func()) {
		t.Helper()
		cs, _, stop, err := startShim(t, filepath.Join(dir, id), path, false, func(o *shim.Options) {
			o.EtcdServers, o.EtcdPrefix = info.EtcdServers, etcdPrefix
			o.Rekey = layer.Flags{ClusterCoordination: true, CoordinationPrefix: "/rekey-straggler-test",
				APIServerID: "shim-" + id, ClusterLeaseTTL: 2 * time.Second}
		})
		if err != nil {
			t.Fatalf("shim %s did not start: %v", id, err)
		}
		return cs, stop
	}
	a, stopA := start("a", newPath)
	defer stopA()
	_, stopB := start("b", newPath)
	defer stopB()
	c, stopC := start("c", oldPath)
	defer stopC()

	ctx := t.Context()
	refused := func(op string, err error) {
		t.Helper()
		var st *apierrors.StatusError
		if !errors.As(err, &st) || st.ErrStatus.Code != http.StatusServiceUnavailable || !apierrors.IsServiceUnavailable(err) ||
			!strings.Contains(st.ErrStatus.Message, "cannot read aesgcm/k2") {
			t.Fatalf("%s on the straggler: %v, want 503 ServiceUnavailable naming aesgcm/k2", op, err)
		}
	}
	secret := func(name string) *corev1.Secret {
		return &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Type: corev1.SecretTypeOpaque,
			Data: map[string][]byte{"k": []byte("v")}}
	}
	_, err := c.CoreV1().Secrets("straggler").Create(ctx, secret("new"), metav1.CreateOptions{})
	refused("create", err)

	// An object c can read (stored under k1, as kube-apiserver with c's file writes it):
	// c reads it, refuses to update it and may delete it (a delete encrypts nothing).
	cli, err := testbed.EtcdClient(info.EtcdServers)
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	up, err := testbed.Upstream(ctx, oldPath)
	if err != nil {
		t.Fatal(err)
	}
	old := secret("old")
	old.Namespace, old.UID, old.CreationTimestamp = "straggler", "u-old", metav1.Now()
	if err := testbed.WriteStored(ctx, cli, up, corev1.Resource("secrets"), etcdPrefix+"/secrets/straggler/old", old); err != nil {
		t.Fatal(err)
	}
	got, err := c.CoreV1().Secrets("straggler").Get(ctx, "old", metav1.GetOptions{})
	if err != nil {
		t.Fatalf("read on the straggler: %v", err)
	}
	got.Data["k"] = []byte("changed")
	_, err = c.CoreV1().Secrets("straggler").Update(ctx, got, metav1.UpdateOptions{})
	refused("update", err)
	if err := c.CoreV1().Secrets("straggler").Delete(ctx, "old", metav1.DeleteOptions{}); err != nil {
		t.Fatalf("delete on the straggler: %v", err)
	}

	if _, err := a.CoreV1().Secrets("straggler").Create(ctx, secret("on-a"), metav1.CreateOptions{}); err != nil {
		t.Fatalf("create on a, which is no straggler: %v", err)
	}
}
