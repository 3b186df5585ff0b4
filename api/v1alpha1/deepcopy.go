package v1alpha1

import (
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
)

// Hand-written deep copies (deepcopy_test.go checks that a copy shares no memory with
// its original for every field filled in).

func (in *ControlPlaneEncryption) DeepCopyInto(out *ControlPlaneEncryption) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	in.Spec.DeepCopyInto(&out.Spec)
	in.Status.DeepCopyInto(&out.Status)
}

func (in *ControlPlaneEncryption) DeepCopy() *ControlPlaneEncryption {
	if in == nil {
		return nil
	}
	out := new(ControlPlaneEncryption)
	in.DeepCopyInto(out)
	return out
}

func (in *ControlPlaneEncryption) DeepCopyObject() runtime.Object { return in.DeepCopy() }

func (in *ControlPlaneEncryptionList) DeepCopyInto(out *ControlPlaneEncryptionList) {
	*out = *in
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]ControlPlaneEncryption, len(in.Items))
		for i := range in.Items {
			in.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

func (in *ControlPlaneEncryptionList) DeepCopy() *ControlPlaneEncryptionList {
	if in == nil {
		return nil
	}
	out := new(ControlPlaneEncryptionList)
	in.DeepCopyInto(out)
	return out
}

func (in *ControlPlaneEncryptionList) DeepCopyObject() runtime.Object { return in.DeepCopy() }

func (in *ControlPlaneEncryptionSpec) DeepCopyInto(out *ControlPlaneEncryptionSpec) {
	*out = *in
	out.RotationPeriod = copyDuration(in.RotationPeriod)
	if in.Provider != nil {
		p := *in.Provider
		if p.KMS != nil {
			k := *p.KMS
			k.Timeout = copyDuration(k.Timeout)
			p.KMS = &k
		}
		out.Provider = &p
	}
	in.Etcd.DeepCopyInto(&out.Etcd)
	out.Resources = slices.Clone(in.Resources)
	out.Timeout = copyDuration(in.Timeout)
}

func (in *EtcdAccess) DeepCopyInto(out *EtcdAccess) {
	*out = *in
	out.Endpoints = slices.Clone(in.Endpoints)
	if in.TLSSecretRef != nil {
		r := *in.TLSSecretRef
		out.TLSSecretRef = &r
	}
}

func (in *ControlPlaneEncryptionStatus) DeepCopyInto(out *ControlPlaneEncryptionStatus) {
	*out = *in
	if in.Rotation != nil {
		out.Rotation = new(RotationRecord)
		in.Rotation.DeepCopyInto(out.Rotation)
	}
	out.LastInitiationTime = copyTime(in.LastInitiationTime)
	out.LastInitiationFinishedTime = copyTime(in.LastInitiationFinishedTime)
	out.LastCompletionTime = copyTime(in.LastCompletionTime)
	out.ActiveKey = copyKey(in.ActiveKey)
	out.TargetKey = copyKey(in.TargetKey)
	if in.History != nil {
		out.History = make([]RotationRecord, len(in.History))
		for i := range in.History {
			in.History[i].DeepCopyInto(&out.History[i])
		}
	}
	if in.Conditions != nil {
		out.Conditions = make([]metav1.Condition, len(in.Conditions))
		for i := range in.Conditions {
			in.Conditions[i].DeepCopyInto(&out.Conditions[i])
		}
	}
	out.Stragglers = slices.Clone(in.Stragglers)
}

func (in *ControlPlaneEncryptionStatus) DeepCopy() *ControlPlaneEncryptionStatus {
	if in == nil {
		return nil
	}
	out := new(ControlPlaneEncryptionStatus)
	in.DeepCopyInto(out)
	return out
}

func (in *RotationRecord) DeepCopyInto(out *RotationRecord) {
	*out = *in
	out.Triggers = slices.Clone(in.Triggers)
	in.StartedTime.DeepCopyInto(&out.StartedTime)
	out.CompletionTime = copyTime(in.CompletionTime)
	out.Key = copyKey(in.Key)
}

func copyDuration(d *metav1.Duration) *metav1.Duration {
	if d == nil {
		return nil
	}
	c := *d
	return &c
}

func copyTime(t *metav1.Time) *metav1.Time {
	if t == nil {
		return nil
	}
	return t.DeepCopy()
}

func copyKey(k *KeyRef) *KeyRef {
	if k == nil {
		return nil
	}
	c := *k
	return &c
}

func (in *EncryptionState) DeepCopyInto(out *EncryptionState) {
	*out = *in
	out.TypeMeta = in.TypeMeta
	in.ObjectMeta.DeepCopyInto(&out.ObjectMeta)
	in.Status.DeepCopyInto(&out.Status)
}

func (in *EncryptionState) DeepCopy() *EncryptionState {
	if in == nil {
		return nil
	}
	out := new(EncryptionState)
	in.DeepCopyInto(out)
	return out
}

func (in *EncryptionState) DeepCopyObject() runtime.Object { return in.DeepCopy() }

func (in *EncryptionStateList) DeepCopyInto(out *EncryptionStateList) {
	*out = *in
	in.ListMeta.DeepCopyInto(&out.ListMeta)
	if in.Items != nil {
		out.Items = make([]EncryptionState, len(in.Items))
		for i := range in.Items {
			in.Items[i].DeepCopyInto(&out.Items[i])
		}
	}
}

func (in *EncryptionStateList) DeepCopy() *EncryptionStateList {
	if in == nil {
		return nil
	}
	out := new(EncryptionStateList)
	in.DeepCopyInto(out)
	return out
}

func (in *EncryptionStateList) DeepCopyObject() runtime.Object { return in.DeepCopy() }

func (in *EncryptionStateStatus) DeepCopyInto(out *EncryptionStateStatus) {
	*out = *in
	if in.Resources != nil {
		out.Resources = make([]ResourceEncryptionState, len(in.Resources))
		for i := range in.Resources {
			in.Resources[i].DeepCopyInto(&out.Resources[i])
		}
	}
	out.APIServers = slices.Clone(in.APIServers)
	out.Attention = slices.Clone(in.Attention)
}

func (in *ResourceEncryptionState) DeepCopyInto(out *ResourceEncryptionState) {
	*out = *in
	in.InventoryTime.DeepCopyInto(&out.InventoryTime)
	out.ReadKeys = slices.Clone(in.ReadKeys)
	if in.Keys != nil {
		out.Keys = make([]StoredKey, len(in.Keys))
		for i := range in.Keys {
			in.Keys[i].DeepCopyInto(&out.Keys[i])
		}
	}
}

func (in *StoredKey) DeepCopyInto(out *StoredKey) {
	*out = *in
	out.FirstUse = copyTime(in.FirstUse)
	out.Age = copyDuration(in.Age)
	out.Retired = copyTime(in.Retired)
}
