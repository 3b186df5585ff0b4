package e2e

import (
	"bytes"
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// memberStates reads every member record under the test's coordination prefix.
func memberStates(ctx context.Context, cli *clientv3.Client, coord string) (map[string]cluster.MemberState, error) {
	resp, err := cli.Get(ctx, coordination.MembersPrefix(coord), clientv3.WithPrefix())
	if err != nil {
		return nil, err
	}
	out := map[string]cluster.MemberState{}
	for _, kv := range resp.Kvs {
		if kv.Lease == 0 {
			return nil, fmt.Errorf("member key %s is not under a lease", kv.Key)
		}
		st, err := cluster.ParseMemberState(kv.Value)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", kv.Key, err)
		}
		out[strings.TrimPrefix(string(kv.Key), coordination.MembersPrefix(coord))] = st
	}
	return out, nil
}

// secretsRule is the "secrets" resource state of a member record.
func secretsRule(st cluster.MemberState) (cluster.ResourceState, error) {
	for _, r := range st.Resources {
		if r.Resource == "secrets" {
			return r, nil
		}
	}
	return cluster.ResourceState{}, fmt.Errorf("member %s publishes no secrets rule: %+v", st.APIServerID, st.Resources)
}

// createSecret creates a Secret through s and returns the prefix etcd stores it under.
func createSecret(t *testing.T, cli *clientv3.Client, s *testbed.Shim, prefix, ns, name string) string {
	t.Helper()
	ctx := t.Context()
	if _, err := clientFor(t, s).CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
		StringData: map[string]string{"v": "plaintext-" + name}}, metav1.CreateOptions{}); err != nil {
		t.Fatalf("%s creates Secret %s: %v", s.Name, name, err)
	}
	key := prefix + "/secrets/" + ns + "/" + name
	resp, err := cli.Get(ctx, key)
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("%s: not in etcd: %v", key, err)
	}
	v := resp.Kvs[0].Value
	if bytes.Contains(v, []byte("plaintext-"+name)) {
		t.Fatalf("%s: plaintext in etcd", key)
	}
	return string(v[:min(len(v), len("k8s:enc:aesgcm:v1:key1:"))])
}

// Two kube-apiservers with rekey on one 3-member etcd cluster, cluster coordination on,
// each with its own config file. A new write key added first in only one file is held
// by that apiserver — its member record says so and the Secrets it writes stay under
// the old key, as an etcd read of each shows — until the other file has the key too;
// then both write with the new key.
func TestKubeAPIServersFenceOnEtcdCluster(t *testing.T) {
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	ec, err := testbed.StartEtcdCluster(ctx, bins.Etcd, filepath.Join(dir, "etcd"), 3)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(ec.Stop)
	cli, err := ec.Client()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()

	const k1, k2 = "k8s:enc:aesgcm:v1:key1:", "k8s:enc:aesgcm:v1:key2:"
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	old := configOf(rule("secrets", aesgcm("key1", key1), identity))
	both := configOf(rule("secrets", aesgcm("key2", key2), aesgcm("key1", key1), identity))
	saKey := filepath.Join(dir, "sa.key")
	if err := testbed.WriteServiceAccountKey(saKey); err != nil {
		t.Fatal(err)
	}
	prefix, coord := uniquePrefix(t), coordinationPrefix(t)
	ids := []string{"kapi-a", "kapi-b"}
	servers := map[string]*testbed.Shim{}
	paths := map[string]string{}
	for _, id := range ids {
		paths[id] = filepath.Join(dir, id+".yaml")
		writeConfig(t, paths[id], old)
		servers[id] = startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: id, Dir: filepath.Join(dir, id),
			EtcdServers: ec.Endpoints(), EtcdPrefix: prefix, ServiceAccountKey: saKey,
			EncryptionConfig: paths[id], AutomaticReload: true,
			Args: []string{"--apiserver-id", id, "--cluster-lease-ttl", "30s", "--encryption-provider-config-poll-interval", "1s"}})
	}
	a, b := servers["kapi-a"], servers["kapi-b"]
	ns := "kapi-fence"
	if _, err := a.Kubectl(ctx, "", "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	eventually(t, 20*time.Second, 100*time.Millisecond, "both member records on key1", func() error {
		ms, err := memberStates(ctx, cli, coord)
		if err != nil {
			return err
		}
		for _, id := range ids {
			r, err := secretsRule(ms[id])
			if err != nil {
				return err
			}
			if r.Write.Key != "key1" || r.Held != nil {
				return fmt.Errorf("%s: %+v", id, r)
			}
		}
		return nil
	})

	// Only a's file has key2: a holds it, and says so in its member record.
	writeConfig(t, paths["kapi-a"], both)
	eventually(t, 30*time.Second, 100*time.Millisecond, "kapi-a holding key2", func() error {
		ms, err := memberStates(ctx, cli, coord)
		if err != nil {
			return err
		}
		r, err := secretsRule(ms["kapi-a"])
		if err != nil {
			return err
		}
		if r.Held == nil || r.Held.Key != "key2" || r.Write.Key != "key1" || r.HeldSince.IsZero() {
			return fmt.Errorf("kapi-a's secrets rule: %+v", r)
		}
		if len(r.Read) != 3 {
			return fmt.Errorf("kapi-a has not loaded the new file yet: reads %v", r.Read)
		}
		return nil
	})
	for _, s := range []*testbed.Shim{a, b} {
		if p := createSecret(t, cli, s, prefix, ns, "during-hold-by-"+s.Name); p != k1 {
			t.Errorf("%s wrote a Secret under %q while kapi-b cannot read key2, want %q", s.Name, p, k1)
		}
	}

	// b's file gets key2 too: the fence opens and both write with it.
	writeConfig(t, paths["kapi-b"], both)
	for _, s := range []*testbed.Shim{a, b} {
		i := 0
		eventually(t, 30*time.Second, 200*time.Millisecond, s.Name+" writing with key2", func() error {
			i++
			if p := createSecret(t, cli, s, prefix, ns, fmt.Sprintf("after-by-%s-%d", s.Name, i)); p != k2 {
				return fmt.Errorf("written under %q", p)
			}
			return nil
		})
	}
	ms, err := memberStates(ctx, cli, coord)
	if err != nil {
		t.Fatal(err)
	}
	for _, id := range ids {
		if r, err := secretsRule(ms[id]); err != nil || r.Write.Key != "key2" || r.Held != nil {
			t.Errorf("%s's member record after both files have key2: %+v %v", id, r, err)
		}
	}
	// What each wrote during the hold reads back through the other.
	for _, c := range [][2]*testbed.Shim{{a, b}, {b, a}} {
		if _, err := clientFor(t, c[1]).CoreV1().Secrets(ns).Get(ctx, "during-hold-by-"+c[0].Name, metav1.GetOptions{}); err != nil {
			t.Errorf("%s reads what %s wrote during the hold: %v", c[1].Name, c[0].Name, err)
		}
	}
}

// kube-apiserver with rekey on an etcd that serves TLS and requires client
// certificates, given only kube-apiserver's own --etcd-cafile, --etcd-certfile and
// --etcd-keyfile: rekey's etcd clients (the start-up check, the member record, the
// applied state) connect with them, and Secrets are stored encrypted.
func TestKubeAPIServerOnTLSEtcd(t *testing.T) {
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	srv := etcdtest.StartWith(t, etcdtest.Options{TLS: true})
	cli := srv.Client(t)
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, configOf(rule("secrets", aesgcm("key1", testbed.RandomKey()), identity)))
	prefix, coord := uniquePrefix(t), coordinationPrefix(t)
	s := startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: "kube-apiserver-tls", Dir: filepath.Join(dir, "kapi"),
		EtcdServers: []string{srv.Endpoint}, EtcdPrefix: prefix, EncryptionConfig: config, AutomaticReload: true,
		Args: []string{"--etcd-cafile", srv.TLS.CAFile, "--etcd-certfile", srv.TLS.ClientCertFile, "--etcd-keyfile", srv.TLS.ClientKeyFile}})

	ms, err := memberStates(ctx, cli, coord)
	if err != nil || len(ms) != 1 {
		t.Fatalf("member records under %s: %v %v, want one", coordination.MembersPrefix(coord), ms, err)
	}
	for id, st := range ms {
		if r, err := secretsRule(st); err != nil || r.Write.Key != "key1" {
			t.Errorf("member %s: secrets rule %+v %v, want writes with key1", id, r, err)
		}
	}
	if code, body := get(t, s, "/readyz?verbose"); code != 200 || !strings.Contains(body, "[+]"+cluster.ReadyzCheckName+" ok") {
		t.Errorf("/readyz?verbose: %d, want the %s check passing:\n%s", code, cluster.ReadyzCheckName, body)
	}
	ns := "kapi-tls"
	if _, err := s.Kubectl(ctx, "", "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	if p := createSecret(t, cli, s, prefix, ns, "over-tls"); p != "k8s:enc:aesgcm:v1:key1:" {
		t.Errorf("Secret stored as %q, want key1's prefix", p)
	}
	got, err := clientFor(t, s).CoreV1().Secrets(ns).Get(ctx, "over-tls", metav1.GetOptions{})
	if err != nil || string(got.Data["v"]) != "plaintext-over-tls" {
		t.Errorf("reading the Secret back: %v", err)
	}
}
