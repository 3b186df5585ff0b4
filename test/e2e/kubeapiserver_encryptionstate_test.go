package e2e

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/testbed"
)

// kube-apiserver with rekey inside serves rekey.io/v1alpha1 encryptionstates as a
// custom resource it installs itself: a Secret put in plaintext behind its back and
// one under a retired key both show in `kubectl get encryptionstate cluster -o json`,
// every read; a watch sees the update a new Secret brings; kubectl's create, patch and
// delete are refused with what to do. Storage migration is off so that the plaintext
// Secret stays (the one apiserver, the lowest live member, writes the state).
func TestKubeAPIServerEncryptionState(t *testing.T) {
	bins := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	key1 := testbed.RandomKey()
	writeConfig(t, config, configOf(rule("secrets", aesgcm("key1", key1), identity)))
	prefix := uniquePrefix(t)
	s := startKubeAPIServer(t, bins.Rekey, testbed.KubeAPIServerConfig{Name: "kube-apiserver-state", Dir: filepath.Join(dir, "kapi"),
		EtcdPrefix: prefix, EncryptionConfig: config, Args: []string{"--storage-migration=false", "--storage-inventory-interval=1s"}})

	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	plain := `{"kind":"Secret","apiVersion":"v1","metadata":{"name":"planted-plain","namespace":"default","uid":"00000000-0000-0000-0000-00000000000a","creationTimestamp":"2026-11-28T00:00:00Z"},"data":{"k":"dg=="},"type":"Opaque"}`
	if _, err := cli.Put(ctx, prefix+"/secrets/default/planted-plain", plain); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, prefix+"/secrets/default/planted-retired", "k8s:enc:aesgcm:v1:retired:0123456789abcdef0123456789abcdef"); err != nil {
		t.Fatal(err)
	}

	read := func() (*v1alpha1.EncryptionState, string, error) {
		out, err := s.Kubectl(ctx, "", "get", "encryptionstate", v1alpha1.EncryptionStateName, "-o", "json")
		if err != nil {
			return nil, out, err
		}
		var st v1alpha1.EncryptionState
		if err := json.Unmarshal([]byte(out), &st); err != nil {
			return nil, out, err
		}
		return &st, out, nil
	}
	secretsOf := func(st *v1alpha1.EncryptionState) *v1alpha1.ResourceEncryptionState {
		for i := range st.Status.Resources {
			if st.Status.Resources[i].Resource == "secrets" {
				return &st.Status.Resources[i]
			}
		}
		return nil
	}
	hasKey := func(r *v1alpha1.ResourceEncryptionState, provider, name string, inConfig bool) bool {
		for _, k := range r.Keys {
			if k.Provider == provider && k.Name == name && k.InConfiguration == inConfig && k.Objects >= 1 {
				return true
			}
		}
		return false
	}
	var st *v1alpha1.EncryptionState
	var raw string
	eventually(t, 90*time.Second, 500*time.Millisecond, "the planted Secrets in the EncryptionState", func() error {
		var err error
		if st, raw, err = read(); err != nil {
			return fmt.Errorf("%v: %s", err, raw)
		}
		if r := secretsOf(st); r == nil || r.Plaintext != 1 || !hasKey(r, "aesgcm", "retired", false) {
			return fmt.Errorf("not yet: %s", raw)
		}
		return nil
	})
	if strings.Contains(raw, key1) {
		t.Fatal("the EncryptionState holds the key's secret")
	}
	for range 3 { // every read shows them
		st2, raw2, err := read()
		if err != nil || secretsOf(st2).Plaintext != 1 || secretsOf(st2).Unreadable != 1 {
			t.Fatalf("a later read: %v %s", err, raw2)
		}
	}
	if len(st.Status.APIServers) != 1 || !st.Status.APIServers[0].Agrees || st.Status.FIPS == "" || st.Status.ObservedBy == "" {
		t.Errorf("status: %s", raw)
	}
	if out, err := s.Kubectl(ctx, "", "get", "encryptionstates"); err != nil || !strings.Contains(out, "PLAINTEXT") {
		t.Errorf("kubectl get encryptionstates: %v\n%s", err, out)
	}

	// A watch (client-go, the kubeconfig's admin) sees the next inventory's update.
	rc, err := clientcmd.BuildConfigFromFlags("", s.Kubeconfig)
	if err != nil {
		t.Fatal(err)
	}
	w, err := dynamic.NewForConfigOrDie(rc).Resource(v1alpha1.EncryptionStateGroupVersionResource()).Watch(ctx, metav1.ListOptions{ResourceVersion: st.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	if out, err := s.Kubectl(ctx, "", "-n", "default", "create", "secret", "generic", "through-api", "--from-literal=k=v"); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	timeout := time.After(60 * time.Second)
	for seen := false; !seen; {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("the watch ended")
			}
			if ev.Type != watch.Modified {
				continue
			}
			var got v1alpha1.EncryptionState
			if err := runtime.DefaultUnstructuredConverter.FromUnstructured(ev.Object.(*unstructured.Unstructured).Object, &got); err != nil {
				t.Fatal(err)
			}
			r := secretsOf(&got)
			seen = r != nil && hasKey(r, "aesgcm", "key1", true) && r.Plaintext == 1
		case <-timeout:
			t.Fatal("the watch saw no update with the Secret under key1 within 60s")
		}
	}

	// Users read it only.
	refused := func(what string, out string, err error) {
		t.Helper()
		if err == nil || !strings.Contains(out+err.Error(), "read-only") {
			t.Errorf("kubectl %s: %v\n%s\nwant a refusal saying it is read-only", what, err, out)
		}
	}
	out, err := s.Kubectl(ctx, "", "delete", "encryptionstate", v1alpha1.EncryptionStateName)
	refused("delete", out, err)
	out, err = s.Kubectl(ctx, "", "patch", "encryptionstate", v1alpha1.EncryptionStateName, "--type=merge", "-p", `{"status":{"totals":{"plaintext":0}}}`)
	refused("patch", out, err)
	out, err = s.Kubectl(ctx, `{"apiVersion":"rekey.io/v1alpha1","kind":"EncryptionState","metadata":{"name":"mine"}}`, "create", "-f", "-")
	refused("create", out, err)
	if st2, raw2, err := read(); err != nil || secretsOf(st2).Plaintext != 1 {
		t.Errorf("after the refused writes: %v %s", err, raw2)
	}
	// The definition is installed and waited for before the first publish: no failed
	// publish in the log.
	if log := s.Log(1 << 22); strings.Contains(log, "Could not publish the encryption state") {
		t.Errorf("a publish failed:\n%s", log[max(0, strings.Index(log, "Could not publish the encryption state")-200):][:600])
	}
}
