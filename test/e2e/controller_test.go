package e2e

// rekey controller against a management API (dist/kube-apiserver with the CRD
// installed) and a hosted control plane of three apiservers whose configuration is
// projected from a Secret of the management API.

import (
	"context"
	"encoding/json"
	"fmt"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/testbed"
)

// TestControllerRotatesDeclaredRotations: the CRD round-trips every field of the Go
// types; then, with writers and the sampler on the three apiservers, rotationGeneration
// raised twice at once gives one rotation, which waits while one apiserver's copy of
// the Secret is stuck (named in status.stragglers) and completes once it is fixed; the
// annotation gives another, during which the controller is killed after its first
// edit: the next controller resumes it and adds no second key, and the annotation is
// gone; with E2E_LONG=1, a write budget not reached starts nothing, one exceeded
// starts a rotation. 0 failed requests, 0 unreadable reads.
func TestControllerRotatesDeclaredRotations(t *testing.T) {
	requireClusterShim(t)
	bin := rekeyBin(t)
	kapi := kubeAPIServers(t)
	dir := t.TempDir()
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	mgmt := startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: "management", Dir: filepath.Join(dir, "mgmt"), EtcdPrefix: uniquePrefix(t)})
	kube, err := kubernetes.NewForConfig(mgmt.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	dyn, err := dynamic.NewForConfig(mgmt.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	root, err := testbed.ModuleRoot()
	if err != nil {
		t.Fatal(err)
	}
	crd, err := os.ReadFile(filepath.Join(root, "deploy", "controller", "crd.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	if out, err := mgmt.Kubectl(ctx, string(crd), "apply", "-f", "-"); err != nil {
		t.Fatalf("installing the CRD: %v\n%s", err, out)
	}
	if out, err := mgmt.Kubectl(ctx, "", "wait", "--for", "condition=established", "--timeout", "60s", "crd/controlplaneencryptions.rekey.io"); err != nil {
		t.Fatalf("the CRD is not established: %v\n%s", err, out)
	}
	res := dyn.Resource(v1alpha1.GroupVersionResource()).Namespace("default")
	roundTripCRD(ctx, t, res)

	b := newClusterBed(t, bedConfig{name: "controller", objects: 200, coordination: true,
		minDelay: 200 * time.Millisecond, maxDelay: 1500 * time.Millisecond})
	initial := testbed.SecretsConfig(testbed.AESGCM(b.key1)).Render()
	if _, err := kube.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kas-encryption"},
		Data: map[string][]byte{"config.yaml": initial}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	follow := testbed.FollowSecret(ctx, kube.CoreV1(), "default", "kas-encryption", "config.yaml", initial, b.syncer)
	defer follow.Stop()
	obj := &v1alpha1.ControlPlaneEncryption{
		ObjectMeta: metav1.ObjectMeta{Name: "tenant", Namespace: "default"},
		Spec: v1alpha1.ControlPlaneEncryptionSpec{
			ConfigSecretRef: v1alpha1.SecretKeyRef{Name: "kas-encryption", Key: "config.yaml"},
			Etcd:            v1alpha1.EtcdAccess{Endpoints: b.etcd.Endpoints(), EtcdPrefix: b.prefix, CoordinationPrefix: b.coord},
			Timeout:         &metav1.Duration{Duration: 3 * time.Minute},
		},
	}
	if _, err := res.Create(ctx, toU(t, obj), metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	l := b.startLoad()
	var metricsAddr, probeAddr string
	startCtrl := func(n int) *testbed.Process {
		mp, err := testbed.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		pp, err := testbed.FreePort()
		if err != nil {
			t.Fatal(err)
		}
		metricsAddr, probeAddr = fmt.Sprintf("127.0.0.1:%d", mp), fmt.Sprintf("127.0.0.1:%d", pp)
		p, err := testbed.Start(fmt.Sprintf("controller-%d", n), dir, bin, "controller", "--kubeconfig", mgmt.Kubeconfig,
			"--leader-election-namespace", "default", "--leader-election-lease-duration", "3s", "--leader-election-renew-deadline", "2s",
			"--leader-election-retry-period", "500ms", "--metrics-bind-address", metricsAddr, "--health-probe-bind-address", probeAddr,
			"--wait-interval", "200ms", "--resync-period", "2s")
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() {
			p.Stop(10 * time.Second)
			if t.Failed() {
				t.Logf("%s log tail:\n%s", p.Name, p.Log(6000))
			}
		})
		return p
	}
	ctrl := startCtrl(1)

	// Two raises at once: one rotation. One apiserver's copy of the Secret is stuck
	// (a subPath mount): the status names it and the rotation waits until it is fixed.
	const stuck = 2
	stuckID := b.fleet.Shims[stuck].ID
	follow.Stick(stuck)
	start := time.Now()
	for _, g := range []int64{1, 2} {
		if _, err := res.Patch(ctx, "tenant", types.MergePatchType, fmt.Appendf(nil, `{"spec":{"rotationGeneration":%d}}`, g), metav1.PatchOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	waitCPE(ctx, t, res, time.Minute, "waiting for the stuck apiserver "+stuckID, func(o *v1alpha1.ControlPlaneEncryption) bool {
		c := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate)
		return o.Status.Stage == "promote" && len(o.Status.Stragglers) == 1 && o.Status.Stragglers[0].APIServerID == stuckID &&
			strings.Contains(o.Status.Stragglers[0].Reason, "subPath") && c != nil && c.Reason == v1alpha1.ReasonWaitingForAPIServers
	})
	time.Sleep(2 * time.Second)
	if o := waitCPE(ctx, t, res, time.Second, "still waiting", func(*v1alpha1.ControlPlaneEncryption) bool { return true }); o.Status.Stage != "promote" {
		t.Fatalf("the rotation went on to %s with %s's copy stuck", o.Status.Stage, stuckID)
	}
	follow.Unstick(stuck)
	o := waitCPE(ctx, t, res, 3*time.Minute, "Completed with observedRotationGeneration 2", func(o *v1alpha1.ControlPlaneEncryption) bool {
		return o.Status.Phase == v1alpha1.PhaseCompleted && o.Status.ObservedRotationGeneration == 2
	})
	t.Logf("rotationGeneration 0 → 2: Completed in %v", time.Since(start).Round(time.Millisecond))
	if len(o.Status.History) != 1 || o.Status.History[0].Result != v1alpha1.ResultCompleted || o.Status.History[0].Generation != 2 {
		t.Fatalf("history after two raises at once: %+v, want one completed rotation of generation 2", o.Status.History)
	}
	first := secretKeys(ctx, t, kube.CoreV1(), "kas-encryption")
	if len(first) != 1 || first[0] == "key1" {
		t.Fatalf("keys in the Secret after the rotation: %v, want one new key", first)
	}
	if a := o.Status.ActiveKey; a == nil || a.Name != first[0] || a.Provider != "aesgcm" || a.Fingerprint == "" {
		t.Fatalf("activeKey %+v, want aesgcm %s with its check value", a, first[0])
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+first[0]+":"); err != nil {
		t.Fatal(err)
	}

	// The annotation, and the controller killed after the first edit.
	start = time.Now()
	if _, err := res.Patch(ctx, "tenant", types.MergePatchType, fmt.Appendf(nil, `{"metadata":{"annotations":{%q:%q}}}`, v1alpha1.OperationAnnotation, v1alpha1.OperationRotate), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitCPE(ctx, t, res, time.Minute, "the first edit recorded", func(o *v1alpha1.ControlPlaneEncryption) bool {
		return o.Status.Rotation != nil && o.Status.Rotation.FirstEditWritten
	})
	ctrl.Kill()
	<-ctrl.Done()
	mid := secretKeys(ctx, t, kube.CoreV1(), "kas-encryption")
	if len(mid) != 2 || mid[1] != first[0] {
		t.Fatalf("keys in the Secret when the controller was killed: %v, want [<new> %s]", mid, first[0])
	}
	startCtrl(2)
	o = waitCPE(ctx, t, res, 3*time.Minute, "the second rotation Completed", func(o *v1alpha1.ControlPlaneEncryption) bool {
		return o.Status.Phase == v1alpha1.PhaseCompleted && len(o.Status.History) == 2
	})
	t.Logf("annotation → Completed, the controller killed and restarted on the way: %v", time.Since(start).Round(time.Millisecond))
	if _, ok := o.Annotations[v1alpha1.OperationAnnotation]; ok {
		t.Fatal("the annotation is still there after its rotation")
	}
	if h := o.Status.History[0]; !slices.Contains(h.Triggers, v1alpha1.TriggerAnnotation) || h.Key == nil || h.Key.Name != mid[0] {
		t.Fatalf("latest history entry %+v, want the annotation's rotation of %s", h, mid[0])
	}
	if got := secretKeys(ctx, t, kube.CoreV1(), "kas-encryption"); len(got) != 1 || got[0] != mid[0] {
		t.Fatalf("keys in the Secret after the resumed rotation: %v, want only %s (no second new key)", got, mid[0])
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+mid[0]+":"); err != nil {
		t.Fatal(err)
	}
	// The second controller's probes and metrics: ready, and its one rotation counted.
	if code, body := httpGet(t, http.DefaultClient, "http://"+probeAddr+"/readyz"); code != http.StatusOK || strings.TrimSpace(body) != "ok" {
		t.Errorf("/readyz: %d %q", code, body)
	}
	// (The gauge drops just after the status is written: a few tries.)
	for try := 0; ; try++ {
		code, body := httpGet(t, http.DefaultClient, "http://"+metricsAddr+"/metrics")
		if code == http.StatusOK && strings.Contains(body, `rekey_controller_rotations_total{result="completed"} 1`) &&
			strings.Contains(body, "rekey_controller_rotations_running 0") {
			break
		}
		if try == 20 {
			t.Errorf("/metrics does not count one rotation completed and none running:\n%s", body)
			break
		}
		time.Sleep(250 * time.Millisecond)
	}
	// A write budget that is not due, then one that is (E2E_LONG: it adds 25 s).
	if e2eLong() {
		controllerWriteBudget(ctx, t, res, kube, mid[0])
	} else {
		t.Log("E2E_LONG=1 (make e2e-long) also runs the write budget's scenario")
	}
	evs, err := kube.CoreV1().Events("default").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.name=tenant"})
	if err != nil {
		t.Fatal(err)
	}
	var reasons []string
	for _, e := range evs.Items {
		reasons = append(reasons, e.Reason)
		if leaks := strings.Contains(e.Message, b.key1.Secret); leaks {
			t.Errorf("event %s carries key material", e.Reason)
		}
	}
	for _, want := range []string{"RotationStarted", "NewKeyWritten", "RotationResumed", "RotationCompleted"} {
		if !slices.Contains(reasons, want) {
			t.Errorf("no %s event on the object (events: %v)", want, reasons)
		}
	}
	b.finishFollowing(ctx, cancel, follow, l)
}

// controllerWriteBudget: a rotateIfWritesOver the write key is under starts nothing;
// one it is over starts a rotation, which completes with a new key (not prev).
func controllerWriteBudget(ctx context.Context, t *testing.T, res dynamic.ResourceInterface, kube kubernetes.Interface, prev string) {
	t.Helper()
	if _, err := res.Patch(ctx, "tenant", types.MergePatchType, []byte(`{"spec":{"rotateIfWritesOver":1000000000}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(4 * time.Second) // two resync periods
	var o *v1alpha1.ControlPlaneEncryption
	if o = waitCPE(ctx, t, res, time.Second, "read", func(*v1alpha1.ControlPlaneEncryption) bool { return true }); o.Status.Rotation != nil || len(o.Status.History) != 2 {
		t.Fatalf("a rotation started under a write budget of 1,000,000,000: %+v", o.Status)
	}
	start := time.Now()
	if _, err := res.Patch(ctx, "tenant", types.MergePatchType, []byte(`{"spec":{"rotateIfWritesOver":10}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	waitCPE(ctx, t, res, time.Minute, "a rotation for the write budget", func(o *v1alpha1.ControlPlaneEncryption) bool {
		return o.Status.Rotation != nil && slices.Contains(o.Status.Rotation.Triggers, v1alpha1.TriggerWrites)
	})
	// The new key passes 10 writes at once: the budget goes, or it would rotate again.
	if _, err := res.Patch(ctx, "tenant", types.MergePatchType, []byte(`{"spec":{"rotateIfWritesOver":0}}`), metav1.PatchOptions{}); err != nil {
		t.Fatal(err)
	}
	o = waitCPE(ctx, t, res, 3*time.Minute, "the write budget's rotation Completed", func(o *v1alpha1.ControlPlaneEncryption) bool {
		return o.Status.Phase == v1alpha1.PhaseCompleted && len(o.Status.History) == 3
	})
	t.Logf("rotateIfWritesOver exceeded → Completed: %v", time.Since(start).Round(time.Millisecond))
	if got := secretKeys(ctx, t, kube.CoreV1(), "kas-encryption"); len(got) != 1 || got[0] == prev || o.Status.ActiveKey.Name != got[0] {
		t.Fatalf("keys in the Secret after the write budget's rotation: %v (activeKey %s), want one new key", got, o.Status.ActiveKey.Name)
	}
}

// waitCPE polls the object until ok, failing after timeout with its last status.
func waitCPE(ctx context.Context, t *testing.T, res dynamic.ResourceInterface, timeout time.Duration, what string, ok func(*v1alpha1.ControlPlaneEncryption) bool) *v1alpha1.ControlPlaneEncryption {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var last *v1alpha1.ControlPlaneEncryption
	for time.Now().Before(deadline) {
		u, err := res.Get(ctx, "tenant", metav1.GetOptions{})
		if err == nil {
			last = fromU(t, u)
			if ok(last) {
				return last
			}
		}
		time.Sleep(50 * time.Millisecond)
	}
	st, _ := json.MarshalIndent(last, "", "  ")
	t.Fatalf("not %s after %v; the object:\n%s", what, timeout, st)
	return nil
}

func toU(t *testing.T, o *v1alpha1.ControlPlaneEncryption) *unstructured.Unstructured {
	t.Helper()
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o)
	if err != nil {
		t.Fatal(err)
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(v1alpha1.SchemeGroupVersion.String())
	u.SetKind(v1alpha1.Kind)
	return u
}

func fromU(t *testing.T, u *unstructured.Unstructured) *v1alpha1.ControlPlaneEncryption {
	t.Helper()
	var o v1alpha1.ControlPlaneEncryption
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &o); err != nil {
		t.Fatal(err)
	}
	return &o
}

// roundTripCRD writes an object with every field of the types set (status through
// the status subresource) and reads it back equal: a field the CRD's schema lacks is
// pruned by the API server, a wrong type refused.
func roundTripCRD(ctx context.Context, t *testing.T, res dynamic.ResourceInterface) {
	t.Helper()
	now := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	d := &metav1.Duration{Duration: time.Hour}
	key := &v1alpha1.KeyRef{Provider: "aesgcm", Name: "key-1", Fingerprint: "abc"}
	rec := v1alpha1.RotationRecord{Generation: 2, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration, v1alpha1.TriggerAnnotation}, FirstEditWritten: true,
		StartedTime: now, CompletionTime: &now, Result: v1alpha1.ResultCompleted, Key: key, Message: "m"}
	o := &v1alpha1.ControlPlaneEncryption{
		ObjectMeta: metav1.ObjectMeta{Name: "roundtrip", Namespace: "default"},
		Spec: v1alpha1.ControlPlaneEncryptionSpec{
			RotationGeneration: 3, RotationPeriod: d, RotateIfWritesOver: 10,
			Provider:        &v1alpha1.ProviderSpec{Type: "kms", KMS: &v1alpha1.KMSProviderSpec{Name: "k", Endpoint: "unix:///s.sock", Timeout: d}},
			ConfigSecretRef: v1alpha1.SecretKeyRef{Name: "enc", Key: "config.yaml"},
			Etcd:            v1alpha1.EtcdAccess{Endpoints: []string{"https://e:2379"}, EtcdPrefix: "/registry", CoordinationPrefix: "/rekey", TLSSecretRef: &v1alpha1.LocalObjectRef{Name: "tls"}},
			Resources:       []string{"secrets"}, RemoveIdentityFallback: true, Timeout: d,
		},
	}
	created, err := res.Create(ctx, toU(t, o), metav1.CreateOptions{})
	if err != nil {
		t.Fatalf("creating an object with every spec field: %v", err)
	}
	o.Status = v1alpha1.ControlPlaneEncryptionStatus{
		ObservedGeneration: 1, ObservedRotationGeneration: 2, Phase: v1alpha1.PhaseMigrating, Stage: "migrate",
		Rotation: &rec, LastInitiationTime: &now, LastInitiationFinishedTime: &now, LastCompletionTime: &now,
		ActiveKey: key, TargetKey: key, History: []v1alpha1.RotationRecord{rec},
		Conditions: []metav1.Condition{{Type: v1alpha1.ConditionEtcdDataEncryptionUpToDate, Status: metav1.ConditionFalse, ObservedGeneration: 1,
			Reason: v1alpha1.ReasonReEncryptionInProgress, Message: "m", LastTransitionTime: now}},
		Stragglers: []v1alpha1.Straggler{{APIServerID: "a", Reason: "r"}}, Message: "m",
	}
	withStatus := toU(t, o)
	withStatus.SetResourceVersion(created.GetResourceVersion())
	if _, err := res.UpdateStatus(ctx, withStatus, metav1.UpdateOptions{}); err != nil {
		t.Fatalf("writing a status with every field: %v", err)
	}
	u, err := res.Get(ctx, "roundtrip", metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Compared as JSON: what the API server kept of every field (time zones aside).
	got := fromU(t, u)
	for _, part := range []struct {
		name      string
		got, want any
	}{{"spec", got.Spec, o.Spec}, {"status", got.Status, o.Status}} {
		g, _ := json.Marshal(part.got)
		w, _ := json.Marshal(part.want)
		if string(g) != string(w) {
			t.Errorf("%s read back differs:\n got %s\nwant %s", part.name, g, w)
		}
	}
	bad := toU(t, o)
	_ = unstructured.SetNestedField(bad.Object, "rot13", "spec", "provider", "type")
	bad.SetName("refused")
	if _, err := res.Create(ctx, bad, metav1.CreateOptions{}); err == nil {
		t.Error("the API server accepted provider.type rot13")
	}
	if err := res.Delete(ctx, "roundtrip", metav1.DeleteOptions{}); err != nil {
		t.Fatal(err)
	}
}
