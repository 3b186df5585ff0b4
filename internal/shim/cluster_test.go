package shim_test

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
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
	resp, err := cli.Get(context.Background(), cluster.MemberKey(prefix, "shim-c1"))
	if err != nil || len(resp.Kvs) != 1 || resp.Kvs[0].Lease == 0 {
		t.Fatalf("member key: %v %v", resp, err)
	}
	stop()
	resp, err = cli.Get(context.Background(), cluster.MemberKey(prefix, "shim-c1"))
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
