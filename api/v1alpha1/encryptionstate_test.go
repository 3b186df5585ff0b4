package v1alpha1

import (
	"reflect"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// fullState is an EncryptionState with every field filled in.
func fullState() *EncryptionState {
	now := metav1.NewTime(time.Date(2026, 11, 28, 6, 0, 0, 0, time.UTC))
	k := KeyRef{Provider: "aesgcm", Name: "k", Fingerprint: "f"}
	return &EncryptionState{
		TypeMeta:   metav1.TypeMeta{APIVersion: SchemeGroupVersion.String(), Kind: EncryptionStateKind},
		ObjectMeta: metav1.ObjectMeta{Name: EncryptionStateName, Labels: map[string]string{"a": "b"}},
		Status: EncryptionStateStatus{
			ObservedBy: "a", ClusterID: "c", ConfigHash: "h", FIPS: "on", DecryptChecked: true,
			Totals: EncryptionTotals{Objects: 3, Plaintext: 1, Stale: 1, Unreadable: 1, Acknowledged: 1},
			Resources: []ResourceEncryptionState{{
				Resource: "secrets", Revision: 7, InventoryTime: now, WriteKey: k, ReadKeys: []KeyRef{k},
				Objects: 3, Plaintext: 1, Stale: 1, Unreadable: 1, Acknowledged: 1,
				Keys: []StoredKey{{Provider: "aesgcm", Name: "k", Fingerprint: "f", InConfiguration: true, Current: true,
					Objects: 1, Unreadable: 1, Acknowledged: 1, FirstUse: &now, Age: &metav1.Duration{Duration: time.Hour},
					Writes: 5, WriteBudget: 1 << 32, Retired: &now}},
			}},
			APIServers: []APIServerEncryptionState{{ID: "a", Version: "v", ConfigHash: "h", Agrees: true, FIPS: "on"}},
			Attention:  []string{"x"},
		},
	}
}

func TestEncryptionStateDeepCopySharesNothing(t *testing.T) {
	in := fullState()
	out := in.DeepCopy()
	if !reflect.DeepEqual(in, out) {
		t.Fatal("the copy differs from the original")
	}
	shared(t, "EncryptionState", reflect.ValueOf(in).Elem(), reflect.ValueOf(out).Elem())
	var obj runtime.Object = in
	if _, ok := obj.DeepCopyObject().(*EncryptionState); !ok {
		t.Fatal("DeepCopyObject does not return an *EncryptionState")
	}
	l := &EncryptionStateList{Items: []EncryptionState{*in}}
	shared(t, "EncryptionStateList", reflect.ValueOf(l).Elem(), reflect.ValueOf(l.DeepCopy()).Elem())
}

func TestFullStateFillsEveryField(t *testing.T) {
	var walk func(path string, v reflect.Value)
	walk = func(path string, v reflect.Value) {
		switch v.Kind() {
		case reflect.Pointer:
			if v.IsNil() {
				t.Errorf("%s is nil in fullState()", path)
				return
			}
			walk(path, v.Elem())
		case reflect.Slice:
			if v.Len() == 0 {
				t.Errorf("%s is empty in fullState()", path)
				return
			}
			walk(path+"[0]", v.Index(0))
		case reflect.Struct:
			if v.Type().PkgPath() != reflect.TypeFor[EncryptionState]().PkgPath() {
				return
			}
			for i := range v.NumField() {
				walk(path+"."+v.Type().Field(i).Name, v.Field(i))
			}
		default:
			if v.IsZero() {
				t.Errorf("%s is zero in fullState()", path)
			}
		}
	}
	walk("EncryptionState", reflect.ValueOf(fullState()))
}

// TestEncryptionStateCRDMatchesTypes checks the CRD dist/kube-apiserver installs
// (encryptionstate-crd.yaml, embedded as EncryptionStateCRD) against the Go types.
func TestEncryptionStateCRDMatchesTypes(t *testing.T) {
	v := crdVersion(t, "encryptionstate-crd.yaml", "Cluster", EncryptionStateKind, EncryptionStateResource, EncryptionStateListKind)
	props := v["schema"].(map[string]any)["openAPIV3Schema"].(map[string]any)["properties"].(map[string]any)
	check(t, "status", reflect.TypeFor[EncryptionStateStatus](), props["status"].(map[string]any))
}
