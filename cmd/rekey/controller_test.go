package main

import (
	"bytes"
	"context"
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	dynamicfake "k8s.io/client-go/dynamic/fake"
	kubefake "k8s.io/client-go/kubernetes/fake"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/configtest"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
)

var ctrlEpoch = time.Date(2026, 11, 28, 6, 0, 0, 0, time.UTC)

func cpe(mut func(*v1alpha1.ControlPlaneEncryption)) *v1alpha1.ControlPlaneEncryption {
	o := &v1alpha1.ControlPlaneEncryption{
		ObjectMeta: metav1.ObjectMeta{Name: "cp", Namespace: "ns", Generation: 1, CreationTimestamp: metav1.NewTime(ctrlEpoch.Add(-time.Hour))},
		Spec:       v1alpha1.ControlPlaneEncryptionSpec{ConfigSecretRef: v1alpha1.SecretKeyRef{Name: "enc"}, Etcd: v1alpha1.EtcdAccess{Endpoints: []string{"http://127.0.0.1:2379"}}},
	}
	if mut != nil {
		mut(o)
	}
	return o
}

func TestDecideReconcile(t *testing.T) {
	const retry = 5 * time.Minute
	annotate := func(o *v1alpha1.ControlPlaneEncryption) {
		o.Annotations = map[string]string{v1alpha1.OperationAnnotation: v1alpha1.OperationRotate}
	}
	running := func(first bool) func(*v1alpha1.ControlPlaneEncryption) {
		return func(o *v1alpha1.ControlPlaneEncryption) {
			o.Spec.RotationGeneration, o.Status.ObservedRotationGeneration = 1, 1
			o.Status.Rotation = &v1alpha1.RotationRecord{Generation: 1, FirstEditWritten: first, Result: v1alpha1.ResultRunning}
			o.Status.Phase = v1alpha1.PhasePreparing
		}
	}
	failed := func(ago time.Duration) func(*v1alpha1.ControlPlaneEncryption) {
		return func(o *v1alpha1.ControlPlaneEncryption) {
			running(true)(o)
			o.Status.Phase = v1alpha1.PhaseFailed
			setCondition(o, metav1.ConditionFalse, v1alpha1.ReasonFailed, "x", metav1.NewTime(ctrlEpoch.Add(-ago)))
		}
	}
	for _, tc := range []struct {
		name string
		mut  []func(*v1alpha1.ControlPlaneEncryption)
		want ctrlDecision
	}{
		{name: "nothing asked", want: ctrlDecision{}},
		{name: "generation raised", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotationGeneration = 1 }},
			want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration}}},
		{name: "generation raised twice before it was seen: one rotation", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotationGeneration = 2 }},
			want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration}}},
		{name: "generation already taken", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) {
			o.Spec.RotationGeneration, o.Status.ObservedRotationGeneration = 3, 3
		}}, want: ctrlDecision{}},
		{name: "annotation", mut: []func(*v1alpha1.ControlPlaneEncryption){annotate},
			want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerAnnotation}, TakeAnnotation: true}},
		{name: "annotation and generation at once: one rotation", mut: []func(*v1alpha1.ControlPlaneEncryption){annotate, func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotationGeneration = 1 }},
			want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration, v1alpha1.TriggerAnnotation}, TakeAnnotation: true}},
		{name: "recorded rotation before its first edit: resumed, may add the key", mut: []func(*v1alpha1.ControlPlaneEncryption){running(false)},
			want: ctrlDecision{Resume: true}},
		{name: "recorded rotation after its first edit: resumed, never a second key", mut: []func(*v1alpha1.ControlPlaneEncryption){running(true)},
			want: ctrlDecision{Resume: true, ResumeOnly: true}},
		{name: "generation raised while one runs: resumed first, not a second", mut: []func(*v1alpha1.ControlPlaneEncryption){running(true), func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotationGeneration = 5 }},
			want: ctrlDecision{Resume: true, ResumeOnly: true}},
		{name: "annotation while one runs: folded into it", mut: []func(*v1alpha1.ControlPlaneEncryption){running(true), annotate},
			want: ctrlDecision{Resume: true, ResumeOnly: true, TakeAnnotation: true}},
		{name: "failed a minute ago: retried later", mut: []func(*v1alpha1.ControlPlaneEncryption){failed(time.Minute)},
			want: ctrlDecision{After: 4 * time.Minute}},
		{name: "failed long ago: resumed", mut: []func(*v1alpha1.ControlPlaneEncryption){failed(time.Hour)},
			want: ctrlDecision{Resume: true, ResumeOnly: true}},
		{name: "failed a minute ago, annotated: resumed now", mut: []func(*v1alpha1.ControlPlaneEncryption){failed(time.Minute), annotate},
			want: ctrlDecision{Resume: true, ResumeOnly: true, TakeAnnotation: true}},
		{name: "period due since creation", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) {
			o.Spec.RotationPeriod = &metav1.Duration{Duration: 30 * time.Minute}
		}}, want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerPeriod}}},
		{name: "period not due since the last completion", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) {
			o.Spec.RotationPeriod = &metav1.Duration{Duration: 30 * time.Minute}
			done := metav1.NewTime(ctrlEpoch.Add(-10 * time.Minute))
			o.Status.LastCompletionTime = &done
		}}, want: ctrlDecision{After: 20 * time.Minute}},
		{name: "write budget: etcd decides", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotateIfWritesOver = 1000 }},
			want: ctrlDecision{CheckWrites: true}},
		{name: "write budget not read when another trigger starts one", mut: []func(*v1alpha1.ControlPlaneEncryption){func(o *v1alpha1.ControlPlaneEncryption) {
			o.Spec.RotateIfWritesOver, o.Spec.RotationGeneration = 1000, 1
		}}, want: ctrlDecision{Start: true, Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := cpe(nil)
			for _, m := range tc.mut {
				m(o)
			}
			got := decideReconcile(o, ctrlEpoch, retry)
			if fmt.Sprintf("%+v", got) != fmt.Sprintf("%+v", tc.want) {
				t.Fatalf("got  %+v\nwant %+v", got, tc.want)
			}
		})
	}
}

// TestTriggerTakenOnce: once startRotation recorded a rotation, the same object
// (generation raised twice, annotated) asks for no second one: it resumes the one
// recorded, and after it completes nothing is left to do.
func TestTriggerTakenOnce(t *testing.T) {
	o := cpe(func(o *v1alpha1.ControlPlaneEncryption) {
		o.Spec.RotationGeneration = 2
		o.Annotations = map[string]string{v1alpha1.OperationAnnotation: v1alpha1.OperationRotate}
	})
	d := decideReconcile(o, ctrlEpoch, time.Minute)
	if !d.Start {
		t.Fatalf("no rotation started: %+v", d)
	}
	startRotation(o, d, metav1.NewTime(ctrlEpoch))
	delete(o.Annotations, v1alpha1.OperationAnnotation)
	if o.Status.ObservedRotationGeneration != 2 || o.Status.Rotation == nil || o.Status.Rotation.Generation != 2 {
		t.Fatalf("status after start: %+v", o.Status)
	}
	if d2 := decideReconcile(o, ctrlEpoch.Add(time.Second), time.Minute); d2.Start || !d2.Resume {
		t.Fatalf("second reconcile of a started rotation: %+v, want a resume and no start", d2)
	}
	finishRotation(o, rotationRound{}, nil, metav1.NewTime(ctrlEpoch.Add(time.Minute)))
	if d3 := decideReconcile(o, ctrlEpoch.Add(2*time.Minute), time.Minute); d3.Start || d3.Resume {
		t.Fatalf("after the rotation completed: %+v, want nothing", d3)
	}
	// A raise during the rotation gives one more after it.
	o.Spec.RotationGeneration = 4
	if d4 := decideReconcile(o, ctrlEpoch.Add(3*time.Minute), time.Minute); !d4.Start {
		t.Fatalf("raised to 4 after 2 completed: %+v, want a start", d4)
	}
}

const ctrlConfig = "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n      - {name: key1, secret: %s}\n  - identity: {}\n"

// TestRotationStatus follows a rotation's rounds into the status: phases, stragglers
// named with the reason, the keys by fingerprint (and no key material anywhere in the
// status), the history bounded.
func TestRotationStatus(t *testing.T) {
	old := secret(1)
	f, err := rotation.ParseFile(fmt.Appendf(nil, ctrlConfig, old), "secret ns/enc")
	if err != nil {
		t.Fatal(err)
	}
	newSecret := bytes.Repeat([]byte{7}, 32)
	e, err := rotation.Add(f, rotation.Request{Now: ctrlEpoch, Random: bytes.NewReader(append(newSecret, bytes.Repeat([]byte{9}, 64)...))})
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(e.Data, []byte(base64.StdEncoding.EncodeToString(newSecret))) {
		t.Fatal("the new key's secret is not the first bytes of Random: the leak check below would test nothing")
	}
	after, err := rotation.ParseFile(e.Data, "secret ns/enc")
	if err != nil {
		t.Fatal(err)
	}
	o := cpe(func(o *v1alpha1.ControlPlaneEncryption) { o.Spec.RotationGeneration = 1 })
	now := metav1.NewTime(ctrlEpoch)
	startRotation(o, decideReconcile(o, ctrlEpoch, time.Minute), now)
	firstEditRecorded(o, e, nil)
	if o.Status.TargetKey == nil || o.Status.TargetKey.Name != e.NewKey || o.Status.TargetKey.Provider != "aesgcm" || o.Status.TargetKey.Fingerprint == "" {
		t.Fatalf("target key %+v, want aesgcm %s with its check value", o.Status.TargetKey, e.NewKey)
	}
	if !o.Status.Rotation.FirstEditWritten {
		t.Fatal("the first edit is not recorded")
	}
	members := []cluster.MemberState{
		{APIServerID: "a", ConfigHash: after.Config.Hash},
		{APIServerID: "c", ConfigHash: f.Config.Hash},
		{APIServerID: "b", ConfigHash: f.Config.Hash, LastReloadError: "guard refused\nmore"},
	}
	applyRound(o, rotationRound{Ready: rotation.Ready{Stage: rotation.StagePromote, Waiting: "b and c"}, File: after, Members: members}, now)
	st := o.Status
	if st.Phase != v1alpha1.PhasePreparing || st.Stage != "promote" || len(st.Stragglers) != 2 || st.Stragglers[0].APIServerID != "b" || st.Stragglers[1].APIServerID != "c" {
		t.Fatalf("promote with two stragglers: %+v", st)
	}
	if !strings.Contains(st.Stragglers[0].Reason, "refused a newer file: guard refused") || !strings.Contains(st.Stragglers[1].Reason, "subPath") {
		t.Fatalf("straggler reasons: %+v", st.Stragglers)
	}
	if c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate); c == nil || c.Reason != v1alpha1.ReasonWaitingForAPIServers || c.Status != metav1.ConditionFalse {
		t.Fatalf("condition while apiservers lag: %+v", c)
	}
	if st.LastInitiationFinishedTime != nil {
		t.Fatal("initiation finished before every apiserver writes with the new key")
	}
	applyRound(o, rotationRound{Ready: rotation.Ready{Stage: rotation.StageMigrate, Progress: rotation.Progress{Done: 1, Total: 10}}, File: after, Members: members[:1]}, now)
	if o.Status.Phase != v1alpha1.PhaseMigrating || len(o.Status.Stragglers) != 0 || o.Status.LastInitiationFinishedTime == nil {
		t.Fatalf("migrating: %+v", o.Status)
	}
	if c := meta.FindStatusCondition(o.Status.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate); c.Reason != v1alpha1.ReasonReEncryptionInProgress {
		t.Fatalf("condition while migrating: %+v", c)
	}
	applyRound(o, rotationRound{Ready: rotation.Ready{Stage: rotation.StageAck}, File: after, Members: members[:1]}, now)
	if o.Status.Phase != v1alpha1.PhaseCompleting {
		t.Fatalf("ack: phase %s", o.Status.Phase)
	}
	finishRotation(o, rotationRound{File: after, Members: members[:1]}, nil, metav1.NewTime(ctrlEpoch.Add(time.Minute)))
	st = o.Status
	if st.Phase != v1alpha1.PhaseCompleted || st.Rotation != nil || st.TargetKey != nil || st.ActiveKey == nil || st.ActiveKey.Name != e.NewKey || st.LastCompletionTime == nil {
		t.Fatalf("completed: %+v", st)
	}
	if len(st.History) != 1 || st.History[0].Result != v1alpha1.ResultCompleted || st.History[0].Key.Name != e.NewKey {
		t.Fatalf("history: %+v", st.History)
	}
	if c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate); c.Status != metav1.ConditionTrue || c.Reason != v1alpha1.ReasonCompleted {
		t.Fatalf("condition when complete: %+v", c)
	}
	// A failure keeps the rotation recorded for its resume.
	for i := range 12 {
		o.Spec.RotationGeneration++
		startRotation(o, ctrlDecision{Triggers: []v1alpha1.Trigger{v1alpha1.TriggerGeneration}}, now)
		finishRotation(o, rotationRound{}, errors.New("rotate --wait: not complete after 30m, at stage 1/4 (promote): b; run `rekey rotate --wait` again to continue from there"), now)
		if i == 0 && (o.Status.Rotation == nil || o.Status.Phase != v1alpha1.PhaseFailed || !strings.Contains(o.Status.Message, "30m") ||
			strings.Contains(o.Status.Message, "rekey rotate") || !strings.Contains(o.Status.Message, "the controller resumes it")) {
			t.Fatalf("failed: %+v", o.Status)
		}
		o.Status.Rotation = nil
	}
	if len(o.Status.History) != v1alpha1.HistoryLimit {
		t.Fatalf("history holds %d, want %d", len(o.Status.History), v1alpha1.HistoryLimit)
	}
	js, err := json.Marshal(o)
	if err != nil {
		t.Fatal(err)
	}
	if leaks := configtest.Leaks(string(js), old, base64.StdEncoding.EncodeToString(newSecret)); len(leaks) > 0 {
		t.Fatalf("the object carries key material: %q", leaks)
	}
	if !slices.ContainsFunc(o.Status.History, func(r v1alpha1.RotationRecord) bool { return r.Result == v1alpha1.ResultFailed }) {
		t.Fatal("no failed rotation in the history")
	}
}

// TestReconcileTakesATriggerOnce runs reconcile against fake API clients: a raised
// rotationGeneration with the annotation records one rotation in the status and
// removes the annotation; a reconcile of the stale cached object while it runs starts
// nothing; a second controller (a new leader with a stale cache) resumes the recorded
// rotation instead of starting another.
func TestReconcileTakesATriggerOnce(t *testing.T) {
	o := cpe(func(o *v1alpha1.ControlPlaneEncryption) {
		o.Spec.RotationGeneration = 2
		o.Annotations = map[string]string{v1alpha1.OperationAnnotation: v1alpha1.OperationRotate}
	})
	stale, err := toUnstructured(o)
	if err != nil {
		t.Fatal(err)
	}
	gvr := v1alpha1.GroupVersionResource()
	dyn := dynamicfake.NewSimpleDynamicClientWithCustomListKinds(runtime.NewScheme(), map[schema.GroupVersionResource]string{gvr: v1alpha1.ListKind}, stale.DeepCopy())
	kube := kubefake.NewClientset()
	ctx, cancel := context.WithCancel(t.Context())
	newCtrl := func() *controller {
		c, err := newController(controllerOptions{etcdTimeout: 100 * time.Millisecond, retryFailed: time.Hour, maxRotations: 1}, kube, dyn, prometheus.NewRegistry(), klog.Background())
		if err != nil {
			t.Fatal(err)
		}
		c.now = func() time.Time { return ctrlEpoch }
		if err := c.informer.GetStore().Add(stale.DeepCopy()); err != nil {
			t.Fatal(err)
		}
		c.sem <- struct{}{} // the rotation started waits for a slot: nothing runs
		return c
	}
	read := func() *v1alpha1.ControlPlaneEncryption {
		t.Helper()
		u, err := dyn.Resource(gvr).Namespace("ns").Get(ctx, "cp", metav1.GetOptions{})
		if err != nil {
			t.Fatal(err)
		}
		got, err := fromUnstructured(u)
		if err != nil {
			t.Fatal(err)
		}
		return got
	}
	c1 := newCtrl()
	if _, err := c1.reconcile(ctx, "ns/cp"); err != nil {
		t.Fatal(err)
	}
	got := read()
	r := got.Status.Rotation
	if r == nil || r.Generation != 2 || got.Status.ObservedRotationGeneration != 2 || !slices.Equal(r.Triggers, []v1alpha1.Trigger{v1alpha1.TriggerGeneration, v1alpha1.TriggerAnnotation}) {
		t.Fatalf("status after the first reconcile: %+v", got.Status)
	}
	if _, ok := got.Annotations[v1alpha1.OperationAnnotation]; ok {
		t.Fatal("the annotation was not removed once taken")
	}
	started := r.StartedTime
	// The informer has not seen the controller's writes: the same stale object again.
	c1.now = func() time.Time { return ctrlEpoch.Add(time.Minute) }
	if _, err := c1.reconcile(ctx, "ns/cp"); err != nil {
		t.Fatal(err)
	}
	// A new leader whose cache is stale too.
	c2 := newCtrl()
	c2.now = func() time.Time { return ctrlEpoch.Add(2 * time.Minute) }
	if _, err := c2.reconcile(ctx, "ns/cp"); err != nil {
		t.Fatal(err)
	}
	got = read()
	if got.Status.Rotation == nil || !got.Status.Rotation.StartedTime.Equal(&started) || len(got.Status.History) != 0 || got.Status.ObservedRotationGeneration != 2 {
		t.Fatalf("a second rotation was recorded: %+v", got.Status)
	}
	c2.mu.Lock()
	resumed := c2.runs["ns/cp"]
	c2.mu.Unlock()
	if !resumed {
		t.Fatal("the new leader does not resume the recorded rotation")
	}
	cancel()
	c1.wg.Wait()
	c2.wg.Wait()
}
