package v1alpha1

import (
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// full is an object with every field filled in.
func full() *ControlPlaneEncryption {
	now := metav1.NewTime(time.Date(2026, 11, 28, 6, 0, 0, 0, time.UTC))
	d := &metav1.Duration{Duration: time.Hour}
	rec := RotationRecord{Generation: 2, Triggers: []Trigger{TriggerGeneration}, FirstEditWritten: true, StartedTime: now,
		CompletionTime: &now, Result: ResultCompleted, Key: &KeyRef{Provider: "aesgcm", Name: "k", Fingerprint: "f"}, Message: "m"}
	return &ControlPlaneEncryption{
		TypeMeta:   metav1.TypeMeta{APIVersion: SchemeGroupVersion.String(), Kind: Kind},
		ObjectMeta: metav1.ObjectMeta{Name: "cp", Namespace: "ns", Annotations: map[string]string{OperationAnnotation: OperationRotate}},
		Spec: ControlPlaneEncryptionSpec{
			RotationGeneration: 3, RotationPeriod: d, RotateIfWritesOver: 10,
			Provider:        &ProviderSpec{Type: "kms", KMS: &KMSProviderSpec{Name: "k", Endpoint: "unix:///s", Timeout: d}},
			ConfigSecretRef: SecretKeyRef{Name: "enc", Key: "config.yaml"},
			Etcd:            EtcdAccess{Endpoints: []string{"http://e:2379"}, EtcdPrefix: "/registry", CoordinationPrefix: "/rekey", TLSSecretRef: &LocalObjectRef{Name: "tls"}},
			Resources:       []string{"secrets"}, RemoveIdentityFallback: true, Timeout: d,
		},
		Status: ControlPlaneEncryptionStatus{
			ObservedGeneration: 1, ObservedRotationGeneration: 2, Phase: PhaseCompleted, Stage: "done",
			Rotation: rec.DeepCopyPtr(), LastInitiationTime: &now, LastInitiationFinishedTime: &now, LastCompletionTime: &now,
			ActiveKey: &KeyRef{Provider: "aesgcm", Name: "a", Fingerprint: "fa"}, TargetKey: &KeyRef{Provider: "aesgcm", Name: "b", Fingerprint: "fb"},
			History:    []RotationRecord{rec},
			Conditions: []metav1.Condition{{Type: ConditionEtcdDataEncryptionUpToDate, Status: metav1.ConditionTrue, Reason: ReasonCompleted, LastTransitionTime: now}},
			Stragglers: []Straggler{{APIServerID: "a", Reason: "r"}}, Message: "m",
		},
	}
}

// DeepCopyPtr is a test helper: a copy of r on the heap.
func (r RotationRecord) DeepCopyPtr() *RotationRecord {
	out := new(RotationRecord)
	r.DeepCopyInto(out)
	return out
}

func TestDeepCopySharesNothing(t *testing.T) {
	in := full()
	out := in.DeepCopy()
	if !reflect.DeepEqual(in, out) {
		t.Fatalf("the copy differs from the original")
	}
	// Every pointer, slice and map reachable from the copy must be a different
	// allocation from the original's.
	shared(t, "ControlPlaneEncryption", reflect.ValueOf(in).Elem(), reflect.ValueOf(out).Elem())
	var obj runtime.Object = in
	if _, ok := obj.DeepCopyObject().(*ControlPlaneEncryption); !ok {
		t.Fatal("DeepCopyObject does not return a *ControlPlaneEncryption")
	}
	l := &ControlPlaneEncryptionList{Items: []ControlPlaneEncryption{*in}}
	lc := l.DeepCopy()
	shared(t, "ControlPlaneEncryptionList", reflect.ValueOf(l).Elem(), reflect.ValueOf(lc).Elem())
}

func shared(t *testing.T, path string, a, b reflect.Value) {
	t.Helper()
	switch a.Kind() {
	case reflect.Pointer:
		if a.IsNil() {
			return
		}
		if a.Pointer() == b.Pointer() {
			t.Errorf("%s: the copy shares the pointer", path)
		}
		shared(t, path, a.Elem(), b.Elem())
	case reflect.Slice:
		if a.Len() == 0 {
			return
		}
		if a.Pointer() == b.Pointer() {
			t.Errorf("%s: the copy shares the slice", path)
		}
		for i := range a.Len() {
			shared(t, path+"[]", a.Index(i), b.Index(i))
		}
	case reflect.Map:
		if a.Len() > 0 && a.Pointer() == b.Pointer() {
			t.Errorf("%s: the copy shares the map", path)
		}
	case reflect.Struct:
		for i := range a.NumField() {
			if a.Type().Field(i).IsExported() {
				shared(t, path+"."+a.Type().Field(i).Name, a.Field(i), b.Field(i))
			}
		}
	}
}

// TestFullFillsEveryField keeps full honest: a field added to the types without a
// value in full would escape TestDeepCopySharesNothing.
func TestFullFillsEveryField(t *testing.T) {
	var walk func(path string, v reflect.Value)
	walk = func(path string, v reflect.Value) {
		switch v.Kind() {
		case reflect.Pointer:
			if v.IsNil() {
				t.Errorf("%s is nil in full()", path)
				return
			}
			walk(path, v.Elem())
		case reflect.Slice:
			if v.Len() == 0 {
				t.Errorf("%s is empty in full()", path)
				return
			}
			walk(path+"[0]", v.Index(0))
		case reflect.Struct:
			if v.Type().PkgPath() != reflect.TypeFor[ControlPlaneEncryption]().PkgPath() {
				return // metav1 types: their own deep copies
			}
			for i := range v.NumField() {
				walk(path+"."+v.Type().Field(i).Name, v.Field(i))
			}
		default:
			if v.IsZero() {
				t.Errorf("%s is zero in full()", path)
			}
		}
	}
	walk("ControlPlaneEncryption", reflect.ValueOf(full()))
}
