package shim_test

import (
	"context"
	"crypto/fips140"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/layer"
)

var fipsEtcds sync.Map // dir → endpoint of its etcdtest member

// fipsEtcd returns the endpoint of dir's etcdtest member, started on first use; it
// stops when the test that started it ends.
func fipsEtcd(t *testing.T, dir string) string {
	if e, ok := fipsEtcds.Load(dir); ok {
		return e.(string)
	}
	e := etcdtest.Start(t).Endpoint
	fipsEtcds.Store(dir, e)
	return e
}

// startShim runs a shim on dir's embedded etcd. It returns its client and a stop
// function, or the error Run returned before the shim started.
func startShim(t *testing.T, dir, cfgPath string, override bool, mutate ...func(*shim.Options)) (*kubernetes.Clientset, shim.Info, func(), error) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	opts := shim.Options{
		EncryptionConfig:  cfgPath,
		AutomaticReload:   true,
		Rekey:             layer.Flags{AllowDroppingKeysInUse: override},
		DataDir:           filepath.Join(dir, "etcd"),
		EtcdUnsafeNoFsync: true,
		CertDir:           filepath.Join(dir, "certs"),
		Tokens:            map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
		MetricsRegistry:   metrics.NewKubeRegistry(),
		Started:           func(i shim.Info) { started <- i },
	}
	if fips140.Enforced() {
		// The embedded etcd cannot start under GODEBUG=fips140=only (SHA-1 member
		// ids): one etcdtest member (a process) per dir, kept across restarts.
		opts.EtcdServers = []string{fipsEtcd(t, dir)}
	}
	for _, m := range mutate {
		m(&opts)
	}
	go func() { done <- shim.Run(ctx, opts) }()
	select {
	case i := <-started:
		cs := kubernetes.NewForConfigOrDie(&rest.Config{Host: i.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: i.CAFile}})
		return cs, i, func() {
			cancel()
			if err := <-done; err != nil {
				t.Errorf("shim stopped with %v", err)
			}
		}, nil
	case err := <-done:
		cancel()
		return nil, shim.Info{}, nil, err
	case <-time.After(60 * time.Second):
		cancel()
		t.Fatal("shim did not start within 60s")
		return nil, shim.Info{}, nil, nil
	}
}

// A configuration that drops a key still encrypting stored Secrets, put in place while
// the shim is down, is refused at the next start (naming secrets, the key and the
// count) instead of being applied silently; the override starts it anyway.
func TestRestartRefusesConfigDroppingKeyInUse(t *testing.T) {
	dir, err := os.MkdirTemp("", "shim-restart-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	cfgPath := filepath.Join(dir, "encryption.yaml")
	const cfgFmt = "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys: [{name: %s, secret: %q}]\n"
	if err := os.WriteFile(cfgPath, fmt.Appendf(nil, cfgFmt, "key1", testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	cs, _, stop, err := startShim(t, dir, cfgPath, false)
	if err != nil {
		t.Fatalf("start with config A: %v", err)
	}
	ctx := t.Context()
	for i := range 2 {
		if _, err := cs.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%d", i)}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	stop()

	// Config B drops key1 while the shim is down.
	if err := os.WriteFile(cfgPath, fmt.Appendf(nil, cfgFmt, "key2", testbed.RandomKey()), 0o600); err != nil {
		t.Fatal(err)
	}
	_, _, stop, err = startShim(t, dir, cfgPath, false)
	if err == nil {
		stop()
		t.Fatal("the shim started with a configuration that cannot read the stored secrets")
	}
	for _, want := range []string{"refusing to start", `secrets: 2 objects are stored under aesgcm key "key1"`, "--unsafe-allow-dropping-keys-in-use"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("start error %q does not contain %q", err, want)
		}
	}
	// Refused again on the next try: nothing was recorded.
	if _, _, stop, err = startShim(t, dir, cfgPath, false); err == nil {
		stop()
		t.Fatal("second start with config B succeeded")
	}
	_, info, stop, err := startShim(t, dir, cfgPath, true)
	if err != nil {
		t.Fatalf("start with the override: %v", err)
	}
	defer stop()
	// Every successful reload records its configuration.
	cli, err := clientv3.New(clientv3.Config{Endpoints: info.EtcdServers, Logger: zap.NewNop()})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	resp, err := cli.Get(ctx, guard.AppliedStatePrefix, clientv3.WithPrefix())
	if err != nil || len(resp.Kvs) != 1 {
		t.Fatalf("applied state keys: %v, %v", resp, err)
	}
	var before guard.AppliedState
	if err := json.Unmarshal(resp.Kvs[0].Value, &before); err != nil {
		t.Fatal(err)
	}
	b, _ := os.ReadFile(cfgPath)
	if err := os.WriteFile(cfgPath, append(b, "  - identity: {}\n"...), 0o600); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		resp, err := cli.Get(ctx, string(resp.Kvs[0].Key))
		var now guard.AppliedState
		if err == nil && len(resp.Kvs) == 1 && json.Unmarshal(resp.Kvs[0].Value, &now) == nil && now.ConfigHash != before.ConfigHash {
			if n := len(now.Rules[0].Keys); n != 2 {
				t.Fatalf("applied state after the reload has %d keys, want 2", n)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("the applied state was not updated after a reload: %s", resp.Kvs[0].Value)
		}
		time.Sleep(50 * time.Millisecond)
	}
}

// writeKeys writes a kms-plugin keys file with one key named kek1 and a random secret.
func writeKeys(t *testing.T, path string) {
	t.Helper()
	if err := os.WriteFile(path, []byte("keys:\n- name: kek1\n  secret: "+testbed.RandomKey()+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
}

func startPlugin(t *testing.T, socket, keys string) {
	t.Helper()
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: "unix://" + socket, KeysFile: keys})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
}

// A reload that keeps the KMS v2 provider's name but points it at a plugin with
// another keyring is refused (the new plugin cannot decrypt a stored DEK); the same
// keyring behind a new socket is applied.
func TestReloadRefusesKMSPluginWithOtherKeyring(t *testing.T) {
	dir, err := os.MkdirTemp("", "shim-kms-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	keysA, keysB := filepath.Join(dir, "a.yaml"), filepath.Join(dir, "b.yaml")
	writeKeys(t, keysA)
	writeKeys(t, keysB)
	sockA, sockB, sockC := filepath.Join(dir, "a.sock"), filepath.Join(dir, "b.sock"), filepath.Join(dir, "c.sock")
	startPlugin(t, sockA, keysA)
	startPlugin(t, sockB, keysB) // same key name, other secret
	startPlugin(t, sockC, keysA) // same keyring, new socket
	cfg := func(sock string) []byte {
		return fmt.Appendf(nil, "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - kms: {apiVersion: v2, name: plug, endpoint: %q, timeout: 3s}\n", "unix://"+sock)
	}
	cfgPath := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(cfgPath, cfg(sockA), 0o600); err != nil {
		t.Fatal(err)
	}
	cs, info, stop, err := startShim(t, dir, cfgPath, false, func(o *shim.Options) {
		o.Rekey.StorageInventoryInterval = 200 * time.Millisecond
		o.Rekey.StorageCheckInterval = 100 * time.Millisecond
		o.Rekey.KMSStatusInterval, o.Rekey.KMSRetryInterval = 200*time.Millisecond, 200*time.Millisecond
	})
	if err != nil {
		t.Fatal(err)
	}
	defer stop()
	ctx := t.Context()
	deadline := time.Now().Add(30 * time.Second)
	for {
		_, err := cs.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "s"}, StringData: map[string]string{"k": "v"}}, metav1.CreateOptions{})
		if err == nil {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("create with the kms provider: %v", err)
		}
		time.Sleep(100 * time.Millisecond) // the provider's first Status
	}
	status := func() (doc struct {
		ActiveConfigHash string `json:"activeConfigHash"`
		LastError        string `json:"lastError"`
	}, raw []byte) {
		raw, err := cs.CoreV1().RESTClient().Get().AbsPath(info.StatusPath).DoRaw(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(raw, &doc); err != nil {
			t.Fatal(err)
		}
		return doc, raw
	}
	waitFor := func(what string, cond func() bool) {
		t.Helper()
		deadline := time.Now().Add(30 * time.Second)
		for !cond() {
			if time.Now().After(deadline) {
				_, raw := status()
				t.Fatalf("%s: status %s", what, raw)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	// The decrypt guard needs an inventory that has seen the KMS bucket (it keeps one
	// sample key per bucket, which the status document does not show).
	waitFor("an inventory with a KMS v2 bucket", func() bool {
		_, raw := status()
		var doc struct {
			Storage struct {
				Inventory *struct {
					Resources []struct {
						Buckets []struct {
							Provider string `json:"provider"`
						} `json:"buckets"`
					} `json:"resources"`
				} `json:"inventory"`
			} `json:"storage"`
		}
		if json.Unmarshal(raw, &doc) != nil || doc.Storage.Inventory == nil {
			return false
		}
		for _, r := range doc.Storage.Inventory.Resources {
			for _, b := range r.Buckets {
				if b.Provider == "kms" {
					return true
				}
			}
		}
		return false
	})
	before, _ := status()

	if err := os.WriteFile(cfgPath, cfg(sockB), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor("the other keyring refused", func() bool {
		doc, _ := status()
		return strings.Contains(doc.LastError, `secrets: 1 objects are stored under kms provider "plug" key id sha256:`) && strings.Contains(doc.LastError, "cannot decrypt")
	})
	if doc, _ := status(); doc.ActiveConfigHash != before.ActiveConfigHash {
		t.Fatal("the refused configuration was applied")
	}
	if err := os.WriteFile(cfgPath, cfg(sockC), 0o600); err != nil {
		t.Fatal(err)
	}
	waitFor("the same keyring at a new socket applied", func() bool {
		doc, _ := status()
		return doc.ActiveConfigHash != before.ActiveConfigHash
	})
	if _, err := cs.CoreV1().Secrets("default").Get(ctx, "s", metav1.GetOptions{}); err != nil {
		t.Fatalf("reading the secret through the new socket: %v", err)
	}
}
