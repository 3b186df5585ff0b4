package shim_test

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/layer"
)

// stateShim is a shim of its own on the shared etcd, under etcdPrefix, with cluster
// coordination: the API's writer is elected among members.
type stateShim struct {
	info  shim.Info
	rc    *rest.Config
	dyn   dynamic.ResourceInterface
	cs    kubernetes.Interface
	keys  []string // the configuration's key secrets, which must appear nowhere
	etcd  *clientv3.Client
	reg   metrics.KubeRegistry
	stop  func()
	start time.Time
}

func startStateShim(t *testing.T, etcdPrefix string, flags layer.Flags, before func(*clientv3.Client)) *stateShim {
	t.Helper()
	dir := t.TempDir()
	s := &stateShim{keys: []string{testbed.RandomKey(), testbed.RandomKey()}, reg: metrics.NewKubeRegistry()}
	path := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(path, fmt.Appendf(nil, encryptionConfig, s.keys[0], s.keys[1]), 0o600); err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: info.EtcdServers, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cli.Close() })
	s.etcd = cli
	if before != nil {
		before(cli)
	}
	ctx, cancel := context.WithCancel(context.Background())
	started := make(chan shim.Info, 1)
	done := make(chan error, 1)
	s.start = time.Now()
	go func() {
		done <- shim.Run(ctx, shim.Options{
			EncryptionConfig: path, Rekey: flags,
			EtcdServers: info.EtcdServers, EtcdPrefix: etcdPrefix,
			CertDir:         filepath.Join(dir, "certs"),
			Tokens:          map[string]*user.DefaultInfo{token: {Name: "admin", Groups: []string{"system:masters"}}},
			MetricsRegistry: s.reg,
			Started:         func(i shim.Info) { started <- i },
		})
	}()
	stopped := false
	s.stop = func() {
		if !stopped {
			stopped = true
			cancel()
			<-done
		}
	}
	t.Cleanup(s.stop)
	select {
	case s.info = <-started:
	case err := <-done:
		t.Fatalf("shim did not start: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("shim did not start within 60s")
	}
	s.rc = &rest.Config{Host: s.info.URL, BearerToken: token, TLSClientConfig: rest.TLSClientConfig{CAFile: s.info.CAFile}}
	s.cs = kubernetes.NewForConfigOrDie(s.rc)
	s.dyn = dynamic.NewForConfigOrDie(s.rc).Resource(v1alpha1.EncryptionStateGroupVersionResource())
	return s
}

// get reads the cluster's EncryptionState; nil when there is none yet.
func (s *stateShim) get(t *testing.T) (*v1alpha1.EncryptionState, []byte) {
	t.Helper()
	u, err := s.dyn.Get(context.Background(), v1alpha1.EncryptionStateName, metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		return nil, nil
	}
	if err != nil {
		t.Fatal(err)
	}
	return toState(t, u)
}

func toState(t *testing.T, u *unstructured.Unstructured) (*v1alpha1.EncryptionState, []byte) {
	t.Helper()
	raw, err := json.Marshal(u.Object)
	if err != nil {
		t.Fatal(err)
	}
	var st v1alpha1.EncryptionState
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &st); err != nil {
		t.Fatal(err)
	}
	return &st, raw
}

// waitState waits until ok accepts the state.
func (s *stateShim) waitState(t *testing.T, what string, ok func(*v1alpha1.EncryptionState) bool) (*v1alpha1.EncryptionState, []byte) {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st, raw := s.get(t)
		if st != nil && ok(st) {
			return st, raw
		}
		if time.Now().After(deadline) {
			t.Fatalf("the EncryptionState never showed %s: %s", what, raw)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

func resourceOf(st *v1alpha1.EncryptionState, name string) *v1alpha1.ResourceEncryptionState {
	for i := range st.Status.Resources {
		if st.Status.Resources[i].Resource == name {
			return &st.Status.Resources[i]
		}
	}
	return nil
}

func keyOf(r *v1alpha1.ResourceEncryptionState, provider, name string) *v1alpha1.StoredKey {
	for i := range r.Keys {
		if r.Keys[i].Provider == provider && r.Keys[i].Name == name {
			return &r.Keys[i]
		}
	}
	return nil
}

// runPrefixes are an etcd prefix and a coordination prefix of this run's own on the
// shared etcd (a test run again with -count finds an empty cluster).
func runPrefixes(name string) (etcdPrefix, coordinationPrefix string) {
	id := fmt.Sprintf("%s-%d", name, time.Now().UnixNano())
	return "/" + id + "-registry", "/rekey-" + id
}

// plant writes, behind the apiserver's back, a Secret in plaintext and one under a
// key the configuration no longer has.
func plant(t *testing.T, cli *clientv3.Client, etcdPrefix string) {
	t.Helper()
	plain, err := json.Marshal(&corev1.Secret{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
		ObjectMeta: metav1.ObjectMeta{Name: "planted-plain", Namespace: "default", UID: types.UID("00000000-0000-0000-0000-000000000001"),
			CreationTimestamp: metav1.Now()}, Data: map[string][]byte{"k": []byte("v")}, Type: corev1.SecretTypeOpaque})
	if err != nil {
		t.Fatal(err)
	}
	sealed := make([]byte, 64)
	_, _ = rand.Read(sealed)
	ctx := context.Background()
	if _, err := cli.Put(ctx, etcdPrefix+"/secrets/default/planted-plain", string(plain)); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, etcdPrefix+"/secrets/default/planted-retired", "k8s:enc:aesgcm:v1:retired:"+string(sealed)); err != nil {
		t.Fatal(err)
	}
}

// TestEncryptionStateAPI: a shim whose etcd also holds a Secret written in plaintext
// behind its back and one under a retired key shows both in rekey.io/v1alpha1
// encryptionstates, read by client-go as any resource; a watch sees the next
// inventory's update; users' creates, updates and deletes are refused with what to do.
func TestEncryptionStateAPI(t *testing.T) {
	prefix, coord := runPrefixes("state-api")
	s := startStateShim(t, prefix, layer.Flags{ClusterCoordination: true, CoordinationPrefix: coord, APIServerID: "state-1",
		ClusterLeaseTTL: 2 * time.Second, StorageInventoryInterval: 500 * time.Millisecond}, nil)
	ctx := context.Background()
	plant(t, s.etcd, prefix)

	st, raw := s.waitState(t, "the planted plaintext and retired-key Secrets", func(st *v1alpha1.EncryptionState) bool {
		r := resourceOf(st, "secrets")
		return r != nil && r.Plaintext == 1 && keyOf(r, "aesgcm", "retired") != nil
	})
	r := resourceOf(st, "secrets")
	if r.Objects != 2 || r.Unreadable != 1 || r.Stale != 1 {
		t.Errorf("secrets: objects %d unreadable %d stale %d, want 2, 1, 1: %s", r.Objects, r.Unreadable, r.Stale, raw)
	}
	if k := keyOf(r, "aesgcm", "retired"); k.InConfiguration || k.Current || k.Objects != 1 || k.Unreadable != 1 {
		t.Errorf("the retired key: %+v", *k)
	}
	if k := keyOf(r, "identity", ""); k == nil || k.Objects != 1 || k.Current {
		t.Errorf("plaintext: %+v", k)
	}
	if r.WriteKey.Provider != "aesgcm" || r.WriteKey.Name != "key1" || r.WriteKey.Fingerprint == "" {
		t.Errorf("write key %+v, want aesgcm/key1 with its check value", r.WriteKey)
	}
	if len(r.ReadKeys) != 2 || r.Revision == 0 || r.InventoryTime.IsZero() {
		t.Errorf("read keys %v, revision %d, inventory time %v", r.ReadKeys, r.Revision, r.InventoryTime)
	}
	if w := keyOf(r, "aesgcm", "key1"); w != nil {
		t.Errorf("key1 holds nothing yet but is listed: %+v", *w)
	}
	if st.Status.ObservedBy != "state-1" || st.Status.FIPS == "" || st.Status.ConfigHash == "" || st.Status.Totals.Plaintext != 1 {
		t.Errorf("status: %+v", st.Status)
	}
	if len(st.Status.APIServers) != 1 || !st.Status.APIServers[0].Agrees || st.Status.APIServers[0].ConfigHash != st.Status.ConfigHash {
		t.Errorf("apiservers: %+v", st.Status.APIServers)
	}
	if len(st.Status.Attention) == 0 {
		t.Error("nothing needs attention with a plaintext and an unreadable Secret")
	}
	for _, k := range s.keys {
		if strings.Contains(string(raw), k) {
			t.Fatal("the EncryptionState holds a key's secret")
		}
	}
	// Every read shows them, in a list too.
	list, err := s.dyn.List(ctx, metav1.ListOptions{})
	if err != nil || len(list.Items) != 1 {
		t.Fatalf("list: %v, %d items", err, len(list.Items))
	}
	if got, _ := toState(t, &list.Items[0]); resourceOf(got, "secrets").Plaintext != 1 {
		t.Errorf("the listed state lost the plaintext Secret")
	}

	// A watch sees the update a new Secret brings at the next inventory.
	w, err := s.dyn.Watch(ctx, metav1.ListOptions{ResourceVersion: st.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	if _, err := s.cs.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "through-api"},
		Data: map[string][]byte{"k": []byte("v")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	timeout := time.After(30 * time.Second)
	for seen := false; !seen; {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("the watch ended")
			}
			if ev.Type != watch.Modified {
				t.Fatalf("watch event %s: %v", ev.Type, ev.Object)
			}
			got, _ := toState(t, ev.Object.(*unstructured.Unstructured))
			r := resourceOf(got, "secrets")
			seen = r.Objects == 3 && keyOf(r, "aesgcm", "key1") != nil && keyOf(r, "aesgcm", "key1").Current && r.Plaintext == 1
		case <-timeout:
			t.Fatal("the watch saw no update with the new Secret under key1 within 30s")
		}
	}

	// Users only read it.
	checkRefused := func(what string, err error) {
		t.Helper()
		if !apierrors.IsMethodNotSupported(err) || !strings.Contains(err.Error(), "read-only") || !strings.Contains(err.Error(), "get, list or watch") {
			t.Errorf("%s: %v, want 405 saying it is read-only and how to read it", what, err)
		}
	}
	obj := &unstructured.Unstructured{Object: map[string]any{"apiVersion": v1alpha1.SchemeGroupVersion.String(), "kind": v1alpha1.EncryptionStateKind,
		"metadata": map[string]any{"name": "mine"}, "status": map[string]any{"observedBy": "me"}}}
	_, err = s.dyn.Create(ctx, obj, metav1.CreateOptions{})
	checkRefused("create", err)
	cur, err := s.dyn.Get(ctx, v1alpha1.EncryptionStateName, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	_ = unstructured.SetNestedField(cur.Object, int64(0), "status", "totals", "plaintext")
	_, err = s.dyn.Update(ctx, cur, metav1.UpdateOptions{})
	checkRefused("update", err)
	_, err = s.dyn.Patch(ctx, v1alpha1.EncryptionStateName, types.MergePatchType, []byte(`{"status":{"totals":{"plaintext":0}}}`), metav1.PatchOptions{})
	checkRefused("patch", err)
	checkRefused("delete", s.dyn.Delete(ctx, v1alpha1.EncryptionStateName, metav1.DeleteOptions{}))
	checkRefused("deletecollection", s.dyn.DeleteCollection(ctx, metav1.DeleteOptions{}, metav1.ListOptions{}))
	if st, _ := s.get(t); st == nil || resourceOf(st, "secrets").Plaintext != 1 {
		t.Error("a refused write changed the state")
	}

	// kubectl get prints the distribution's columns.
	body, err := s.cs.Discovery().RESTClient().Get().AbsPath("/apis/rekey.io/v1alpha1/encryptionstates").
		SetHeader("Accept", "application/json;as=Table;v=v1;g=meta.k8s.io").DoRaw(ctx)
	if err != nil {
		t.Fatal(err)
	}
	var table metav1.Table
	if err := json.Unmarshal(body, &table); err != nil || len(table.Rows) != 1 || len(table.ColumnDefinitions) != 8 ||
		table.ColumnDefinitions[2].Name != "Plaintext" || table.Rows[0].Cells[2] != float64(1) {
		t.Errorf("table: %v %s", err, body)
	}

	// Discovery says what a client may do: read.
	res, err := s.cs.Discovery().ServerResourcesForGroupVersion(v1alpha1.SchemeGroupVersion.String())
	if err != nil {
		t.Fatal(err)
	}
	found := false
	for _, ar := range res.APIResources {
		if ar.Name == v1alpha1.EncryptionStateResource {
			found = true
			verbs := slices.Sorted(slices.Values(ar.Verbs))
			if !slices.Equal(verbs, []string{"get", "list", "watch"}) || ar.Namespaced || ar.Kind != v1alpha1.EncryptionStateKind {
				t.Errorf("discovery: %+v", ar)
			}
		}
	}
	if !found {
		t.Errorf("discovery does not list %s: %+v", v1alpha1.EncryptionStateResource, res.APIResources)
	}
}

// TestEncryptionStateDuringMigration: the elected migration leader keeps the state
// current while it migrates Secrets stored in plaintext to the write key; at the end
// the state shows none left. It logs what keeping the state current cost (updates a
// watch saw, time spent building and publishing) for the benchmark notes.
func TestEncryptionStateDuringMigration(t *testing.T) {
	prefix, coord := runPrefixes("state-migration")
	n := 2000
	if testing.Short() {
		n = 200
	}
	s := startStateShim(t, prefix, layer.Flags{StorageMigration: true, ClusterCoordination: true, CoordinationPrefix: coord,
		APIServerID: "state-m1", ClusterLeaseTTL: 2 * time.Second, StorageCheckInterval: 500 * time.Millisecond, StorageInventoryInterval: 2 * time.Second,
		// Paced so that the migration spans several inventories, as a large one does.
		StorageMigrationRate: 250},
		func(cli *clientv3.Client) {
			ctx := context.Background()
			for i := range n {
				name := fmt.Sprintf("s%05d", i)
				b, _ := json.Marshal(&corev1.Secret{TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "Secret"},
					ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: "default", UID: types.UID(fmt.Sprintf("00000000-0000-0000-0000-%012d", i)),
						CreationTimestamp: metav1.Now()}, Data: map[string][]byte{"k": make([]byte, 512)}, Type: corev1.SecretTypeOpaque})
				if _, err := cli.Put(ctx, prefix+"/secrets/default/"+name, string(b)); err != nil {
					t.Fatal(err)
				}
			}
		})
	ctx := context.Background()
	// Watch from the first state on, counting every update until the migration is done.
	var first *v1alpha1.EncryptionState
	for deadline := time.Now().Add(60 * time.Second); first == nil; time.Sleep(20 * time.Millisecond) {
		if first, _ = s.get(t); first == nil && time.Now().After(deadline) {
			t.Fatal("no EncryptionState within 60s")
		}
	}
	w, err := s.dyn.Watch(ctx, metav1.ListOptions{ResourceVersion: first.ResourceVersion})
	if err != nil {
		t.Fatal(err)
	}
	defer w.Stop()
	updates, sawPlaintext := 0, resourceOf(first, "secrets") != nil && resourceOf(first, "secrets").Plaintext > 0
	timeout := time.After(5 * time.Minute)
	var last *v1alpha1.EncryptionState
	for done := false; !done; {
		select {
		case ev, ok := <-w.ResultChan():
			if !ok {
				t.Fatal("the watch ended")
			}
			if ev.Type != watch.Modified {
				t.Fatalf("watch event %s: %v", ev.Type, ev.Object)
			}
			updates++
			last, _ = toState(t, ev.Object.(*unstructured.Unstructured))
			r := resourceOf(last, "secrets")
			if r != nil && r.Plaintext > 0 {
				sawPlaintext = true
			}
			done = r != nil && r.Objects == int64(n) && r.Plaintext == 0 && r.Stale == 0
		case <-timeout:
			t.Fatalf("the state never showed every Secret on key1 within 5m (%d updates seen)", updates)
		}
	}
	elapsed := time.Since(s.start)
	// Whether a state in between showed plaintext depends on when the inventories fell
	// (one every StorageInventoryInterval): logged, not required.
	if k := keyOf(resourceOf(last, "secrets"), "aesgcm", "key1"); k == nil || k.Objects != int64(n) || !k.Current {
		t.Errorf("key1 after the migration: %+v", k)
	}
	mfs, err := s.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var written, unchanged, buildSec, publishSec float64
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			switch mf.GetName() {
			case "rekey_encryption_state_publishes_total":
				for _, l := range m.GetLabel() {
					if l.GetName() == "result" && l.GetValue() == "written" {
						written = m.GetCounter().GetValue()
					}
					if l.GetName() == "result" && l.GetValue() == "unchanged" {
						unchanged = m.GetCounter().GetValue()
					}
				}
			case "rekey_encryption_state_build_seconds_total":
				buildSec = m.GetCounter().GetValue()
			case "rekey_encryption_state_publish_seconds_total":
				publishSec = m.GetCounter().GetValue()
			}
		}
	}
	if written < 2 {
		t.Errorf("%v writes of the state, want at least the first and the migrated one", written)
	}
	t.Logf("encryption state during a migration of %d plaintext Secrets: %v from start to every Secret on key1; "+
		"%d updates seen by a watch (a state with plaintext among them: %v), %v written (%v unchanged), building %.1f ms, publishing %.1f ms in all",
		n, elapsed.Round(time.Millisecond), updates, sawPlaintext, written, unchanged, buildSec*1000, publishSec*1000)
}
