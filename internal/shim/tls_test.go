package shim_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/layer"
)

// tlsShimOptions are the options of a clustered shim on srv, an etcd that requires a
// client certificate; the caller picks which TLS files to pass.
func tlsShimOptions(t *testing.T, srv *etcdtest.Server, id string) shim.Options {
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(path, fmt.Appendf(nil, encryptionConfig, testbed.RandomKey(), testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	return shim.Options{
		EncryptionConfig: path, AutomaticReload: true,
		Rekey:       layer.Flags{StorageMigration: true, ClusterCoordination: true, APIServerID: id, ClusterLeaseTTL: 2 * time.Second},
		EtcdServers: []string{srv.Endpoint}, EtcdConnectTimeout: 3 * time.Second,
		EtcdCAFile: srv.TLS.CAFile, EtcdCertFile: srv.TLS.ClientCertFile, EtcdKeyFile: srv.TLS.ClientKeyFile,
		CertDir:         filepath.Join(dir, "certs"),
		Tokens:          map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
		MetricsRegistry: metrics.NewKubeRegistry(),
	}
}

// TestClusterOverTLSEtcd runs a clustered shim against an etcd that requires client
// certificates, with kube-apiserver's --etcd-cafile/--etcd-certfile/--etcd-keyfile: the
// storage backend serves an encrypted Secret, and the layer's own clients (cluster node,
// applied-state check) reach etcd too — the member key and the applied state are there.
func TestClusterOverTLSEtcd(t *testing.T) {
	srv := etcdtest.StartWith(t, etcdtest.Options{TLS: true})
	o := tlsShimOptions(t, srv, "shim-tls-1")
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	o.Started = func(i shim.Info) { started <- i }
	go func() { done <- shim.Run(ctx, o) }()
	var si shim.Info
	select {
	case si = <-started:
	case err := <-done:
		cancel()
		t.Fatalf("shim on TLS etcd did not start: %v", err)
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("shim on TLS etcd did not start within 60s")
	}
	defer func() {
		cancel()
		<-done
	}()

	c := kubernetes.NewForConfigOrDie(&rest.Config{Host: si.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: si.CAFile}})
	secrets := c.CoreV1().Secrets("tls")
	if _, err := secrets.Create(t.Context(), &corev1.Secret{
		ObjectMeta: metav1.ObjectMeta{Name: "s1"},
		StringData: map[string]string{"password": "over-tls-plaintext"},
	}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("create a Secret through the shim on TLS etcd: %v", err)
	}
	got, err := secrets.Get(t.Context(), "s1", metav1.GetOptions{})
	if err != nil || string(got.Data["password"]) != "over-tls-plaintext" {
		t.Fatalf("get: %v %v", got, err)
	}

	cli := srv.Client(t)
	raw, err := cli.Get(t.Context(), "/registry/secrets/tls/s1")
	if err != nil || len(raw.Kvs) != 1 || !strings.HasPrefix(string(raw.Kvs[0].Value), "k8s:enc:aesgcm:v1:key1:") {
		t.Fatalf("stored Secret is not encrypted with key1: %v %v", err, raw)
	}
	member, err := cli.Get(t.Context(), coordination.Member(coordination.DefaultPrefix, "shim-tls-1"))
	if err != nil || len(member.Kvs) != 1 || member.Kvs[0].Lease == 0 {
		t.Fatalf("member key %s over TLS: %v %+v", coordination.Member(coordination.DefaultPrefix, "shim-tls-1"), err, member)
	}
	applied, err := cli.Get(t.Context(), guard.AppliedStatePrefix, clientv3.WithPrefix(), clientv3.WithCountOnly())
	if err != nil || applied.Count == 0 {
		t.Fatalf("no applied state under %s: the start-up check did not reach TLS etcd (%v)", guard.AppliedStatePrefix, err)
	}
}

// TestTLSEtcdWithoutClientCertFails starts a shim against an etcd that requires client
// certificates with only --etcd-cafile: it must fail at start, naming the TLS flags,
// instead of serving errors.
func TestTLSEtcdWithoutClientCertFails(t *testing.T) {
	srv := etcdtest.StartWith(t, etcdtest.Options{TLS: true})
	o := tlsShimOptions(t, srv, "shim-tls-2")
	o.EtcdCertFile, o.EtcdKeyFile = "", ""
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := shim.Run(ctx, o)
	if err == nil {
		t.Fatal("shim started on an etcd that requires a client certificate without one")
	}
	for _, want := range []string{srv.Endpoint, "--etcd-certfile", "--etcd-keyfile"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not mention %s", err, want)
		}
	}

	// Half a client pair is refused before anything is dialled.
	o.EtcdCertFile = srv.TLS.ClientCertFile
	if err := shim.Run(ctx, o); err == nil || !strings.Contains(err.Error(), "--etcd-keyfile") {
		t.Errorf("--etcd-certfile without --etcd-keyfile: %v", err)
	}
}
