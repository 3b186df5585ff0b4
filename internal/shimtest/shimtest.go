// Package shimtest starts the apiserver shim in the test's own process, on an embedded
// etcd (an etcdtest member under GODEBUG=fips140=only), for tests that need a real Kubernetes API (a Secret read and updated with
// resourceVersion compare-and-swap, as a platform's management cluster serves it)
// without the process harness of internal/testbed.
package shimtest

import (
	"context"
	"crypto/fips140"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"
	clientcmdapi "k8s.io/client-go/tools/clientcmd/api"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/pkg/layer"
)

// API is a running shim.
type API struct {
	Config *rest.Config
	Client kubernetes.Interface
	// Kubeconfig is a kubeconfig file for Config (its token is an administrator's).
	Kubeconfig string
	// EtcdServers and EtcdPrefix are where it stores (its embedded etcd), for tests
	// that write behind its back.
	EtcdServers []string
	EtcdPrefix  string
}

const token = "shimtest-admin-token"

// identityConfig stores the API's own objects in plaintext: what the tests look at
// is the objects, not how this API stores them.
const identityConfig = `apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - identity: {}
`

// Start runs a shim until the test ends and returns once it is ready.
func Start(t testing.TB) *API {
	t.Helper()
	return StartWithFlags(t, layer.Flags{})
}

// StartWithFlags is Start with the layer's flags (a short inventory interval, say).
func StartWithFlags(t testing.TB, flags layer.Flags) *API {
	t.Helper()
	dir := t.TempDir()
	cfgPath := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(cfgPath, []byte(identityConfig), 0o600); err != nil {
		t.Fatal(err)
	}
	var etcdServers []string
	if fips140.Enforced() {
		// The shim's embedded etcd cannot run under GODEBUG=fips140=only (SHA-1 member
		// ids); etcdtest runs one as a process there.
		etcdServers = []string{etcdtest.Start(t).Endpoint}
	}
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	go func() {
		done <- shim.Run(ctx, shim.Options{
			EncryptionConfig:  cfgPath,
			Rekey:             flags,
			EtcdServers:       etcdServers,
			DataDir:           filepath.Join(dir, "etcd"),
			EtcdUnsafeNoFsync: true,
			CertDir:           filepath.Join(dir, "certs"),
			Tokens:            map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
			MetricsRegistry:   metrics.NewKubeRegistry(),
			Started:           func(i shim.Info) { started <- i },
		})
	}()
	t.Cleanup(func() {
		cancel()
		<-done
	})
	var info shim.Info
	select {
	case info = <-started:
	case err := <-done:
		t.Fatalf("the shim did not start: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("the shim did not start within 60s")
	}
	rc := &rest.Config{Host: info.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: info.CAFile}}
	cs, err := kubernetes.NewForConfig(rc)
	if err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(30 * time.Second); ; time.Sleep(50 * time.Millisecond) {
		_, err := cs.Discovery().RESTClient().Get().AbsPath("/readyz").DoRaw(ctx)
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the shim is not ready after 30s: %v", err)
		}
	}
	kubeconfig := filepath.Join(dir, "kubeconfig")
	kc := clientcmdapi.NewConfig()
	kc.Clusters["shim"] = &clientcmdapi.Cluster{Server: info.URL, CertificateAuthority: info.CAFile}
	kc.AuthInfos["admin"] = &clientcmdapi.AuthInfo{Token: token}
	kc.Contexts["shim"] = &clientcmdapi.Context{Cluster: "shim", AuthInfo: "admin"}
	kc.CurrentContext = "shim"
	if err := clientcmd.WriteToFile(*kc, kubeconfig); err != nil {
		t.Fatal(fmt.Errorf("writing the kubeconfig: %w", err))
	}
	return &API{Config: rc, Client: cs, Kubeconfig: kubeconfig, EtcdServers: info.EtcdServers, EtcdPrefix: info.EtcdPrefix}
}
