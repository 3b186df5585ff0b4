package v1alpha1

import (
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Group and Version of rekey's API.
const (
	Group   = "rekey.io"
	Version = "v1alpha1"
	// Kind and Resource of the controller's object (encryptionstate.go: the other).
	Kind     = "ControlPlaneEncryption"
	ListKind = "ControlPlaneEncryptionList"
	Resource = "controlplaneencryptions"
)

// SchemeGroupVersion is rekey.io/v1alpha1.
var SchemeGroupVersion = schema.GroupVersion{Group: Group, Version: Version}

// GroupVersionResource is the resource the controller watches.
func GroupVersionResource() schema.GroupVersionResource {
	return SchemeGroupVersion.WithResource(Resource)
}

// AddToScheme adds the types of this version to s (the caller's own scheme: nothing
// is registered globally).
func AddToScheme(s *runtime.Scheme) error {
	s.AddKnownTypes(SchemeGroupVersion, &ControlPlaneEncryption{}, &ControlPlaneEncryptionList{},
		&EncryptionState{}, &EncryptionStateList{})
	metav1.AddToGroupVersion(s, SchemeGroupVersion)
	return nil
}

// OperationAnnotation is the one-shot trigger: set to OperationRotate, the controller
// starts a rotation (or folds the request into the one running) and removes the
// annotation once the request is recorded in the status.
const (
	OperationAnnotation = "rekey.io/operation"
	OperationRotate     = "rotate"
)

// ControlPlaneEncryption declares how one managed control plane's encryption
// configuration is rotated, and reports the rotations.
type ControlPlaneEncryption struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Spec   ControlPlaneEncryptionSpec   `json:"spec"`
	Status ControlPlaneEncryptionStatus `json:"status,omitempty"`
}

// ControlPlaneEncryptionList is a list of ControlPlaneEncryption.
type ControlPlaneEncryptionList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []ControlPlaneEncryption `json:"items"`
}

// ControlPlaneEncryptionSpec says where the configuration and the control plane's etcd
// are, and when to rotate.
type ControlPlaneEncryptionSpec struct {
	// RotationGeneration: raise it to rotate now. Every value above
	// status.observedRotationGeneration asks for one rotation; raises while a rotation
	// runs are folded into one rotation after it.
	RotationGeneration int64 `json:"rotationGeneration,omitempty"`
	// RotationPeriod rotates when the last completed rotation (or, before the first,
	// the object's creation) is older than this. Unset: no periodic rotation.
	RotationPeriod *metav1.Duration `json:"rotationPeriod,omitempty"`
	// RotateIfWritesOver rotates when a write key has sealed more values than this, as
	// the apiservers' totals under the coordination prefix say (rekey rotate
	// --if-writes-over). 0: no write budget.
	RotateIfWritesOver int64 `json:"rotateIfWritesOver,omitempty"`
	// Provider is the type of the new write key; unset: the type each rule writes with.
	Provider *ProviderSpec `json:"provider,omitempty"`
	// ConfigSecretRef is the Secret, in the object's namespace, holding the
	// EncryptionConfiguration that is projected into every apiserver's pod.
	ConfigSecretRef SecretKeyRef `json:"configSecretRef"`
	// Etcd is how the controller reaches the control plane's etcd (the coordination
	// keys the apiservers publish, and the stored objects it counts).
	Etcd EtcdAccess `json:"etcd"`
	// Resources narrows the rules rotated (rekey rotate --resources); empty: every rule.
	Resources []string `json:"resources,omitempty"`
	// RemoveIdentityFallback also removes identity from behind the new write key once
	// nothing is stored as plaintext (--remove-identity-fallback).
	RemoveIdentityFallback bool `json:"removeIdentityFallback,omitempty"`
	// Timeout bounds one rotation (--wait-timeout); default 30m. A rotation that times
	// out is Failed; the next trigger resumes it where it stopped.
	Timeout *metav1.Duration `json:"timeout,omitempty"`
}

// ProviderSpec is the new write key's type.
type ProviderSpec struct {
	// Type is aesgcm, secretbox, aescbc (deprecated) or kms (KMS v2).
	Type string `json:"type"`
	// KMS describes the KMS v2 provider added when Type is kms.
	KMS *KMSProviderSpec `json:"kms,omitempty"`
}

// KMSProviderSpec is a KMS v2 provider of the configuration.
type KMSProviderSpec struct {
	// Name is the provider's name in the configuration (unique in it).
	Name string `json:"name"`
	// Endpoint is the plugin's socket, unix:///path, as the apiservers reach it (and
	// the controller: it calls the plugin before writing the configuration).
	Endpoint string `json:"endpoint"`
	// Timeout of the provider; unset: the apiserver's default (3s).
	Timeout *metav1.Duration `json:"timeout,omitempty"`
}

// SecretKeyRef names a key of a Secret in the object's namespace.
type SecretKeyRef struct {
	Name string `json:"name"`
	// Key is the data key; empty: the Secret's only key.
	Key string `json:"key,omitempty"`
}

// EtcdAccess reaches a control plane's etcd.
type EtcdAccess struct {
	// Endpoints are the etcd servers, scheme://host:port.
	Endpoints []string `json:"endpoints"`
	// EtcdPrefix is the apiservers' --etcd-prefix; default /registry.
	EtcdPrefix string `json:"etcdPrefix,omitempty"`
	// CoordinationPrefix is the apiservers' --coordination-prefix; default: theirs
	// for EtcdPrefix.
	CoordinationPrefix string `json:"coordinationPrefix,omitempty"`
	// TLSSecretRef names a Secret in the object's namespace with ca.crt, tls.crt and
	// tls.key for etcd's client TLS; unset: plain connections.
	TLSSecretRef *LocalObjectRef `json:"tlsSecretRef,omitempty"`
}

// LocalObjectRef names an object in the same namespace.
type LocalObjectRef struct {
	Name string `json:"name"`
}

// Phase is where the object's rotation is, in Gardener's words (docs/controller.md
// maps them to rekey's stages).
type Phase string

// Phases.
const (
	// PhasePreparing: reading the configuration and the cluster, writing the new key
	// first (rekey's start and edit), and waiting until every apiserver writes with it
	// (promote).
	PhasePreparing Phase = "Preparing"
	// PhasePrepared: every apiserver writes with the new key.
	PhasePrepared Phase = "Prepared"
	// PhaseMigrating: the elected migration leader re-encrypts what is stored (migrate).
	PhaseMigrating Phase = "Migrating"
	// PhaseCompleting: the old key leaves the configuration and every apiserver loads
	// the final one (remove, ack).
	PhaseCompleting Phase = "Completing"
	// PhaseCompleted: the last rotation is complete.
	PhaseCompleted Phase = "Completed"
	// PhaseFailed: the last rotation stopped; the condition says why and what to do.
	PhaseFailed Phase = "Failed"
)

// Condition type and reasons.
const (
	ConditionEtcdDataEncryptionUpToDate = "EtcdDataEncryptionUpToDate"

	ReasonReEncryptionInProgress = "ReEncryptionInProgress"
	ReasonWaitingForAPIServers   = "WaitingForAPIServers"
	ReasonCompleted              = "Completed"
	ReasonFailed                 = "Failed"
)

// HistoryLimit bounds status.history.
const HistoryLimit = 10

// ControlPlaneEncryptionStatus is what the controller observed and did.
type ControlPlaneEncryptionStatus struct {
	// ObservedGeneration is the metadata.generation the status was written for.
	ObservedGeneration int64 `json:"observedGeneration,omitempty"`
	// ObservedRotationGeneration is the highest spec.rotationGeneration taken.
	ObservedRotationGeneration int64 `json:"observedRotationGeneration,omitempty"`
	Phase                      Phase `json:"phase,omitempty"`
	// Stage is rekey's stage of the running or last rotation: start, edit, promote,
	// migrate, remove, ack, done, failed.
	Stage string `json:"stage,omitempty"`
	// Rotation is the rotation running now; nil when none runs.
	Rotation *RotationRecord `json:"rotation,omitempty"`
	// LastInitiationTime is when the last rotation started; LastInitiationFinishedTime
	// when its preparation finished (every apiserver writes with the new key);
	// LastCompletionTime when it completed.
	LastInitiationTime         *metav1.Time `json:"lastInitiationTime,omitempty"`
	LastInitiationFinishedTime *metav1.Time `json:"lastInitiationFinishedTime,omitempty"`
	LastCompletionTime         *metav1.Time `json:"lastCompletionTime,omitempty"`
	// ActiveKey is the key every apiserver writes with after the last completed
	// rotation; TargetKey the one the running rotation introduces.
	ActiveKey *KeyRef `json:"activeKey,omitempty"`
	TargetKey *KeyRef `json:"targetKey,omitempty"`
	// History lists the last HistoryLimit rotations, newest first.
	History []RotationRecord `json:"history,omitempty"`
	// Conditions: EtcdDataEncryptionUpToDate.
	Conditions []metav1.Condition `json:"conditions,omitempty"`
	// Stragglers are the apiservers the running stage waits for, with why.
	Stragglers []Straggler `json:"stragglers,omitempty"`
	// Message says what the stage waits for, or why it failed and what to do.
	Message string `json:"message,omitempty"`
}

// KeyRef names a key without its material.
type KeyRef struct {
	// Provider is aesgcm, aescbc, secretbox or kms.
	Provider string `json:"provider"`
	// Name is the key's name (local keys) or the KMS provider's name.
	Name string `json:"name"`
	// Fingerprint is a local key's check value, or "sha256:…" of the KMS v2 key id;
	// empty until known.
	Fingerprint string `json:"fingerprint,omitempty"`
}

// Trigger is what started a rotation.
type Trigger string

// Triggers.
const (
	TriggerGeneration Trigger = "RotationGeneration"
	TriggerAnnotation Trigger = "Annotation"
	TriggerPeriod     Trigger = "RotationPeriod"
	TriggerWrites     Trigger = "WriteBudget"
	// TriggerResume: a rotation found in progress (an interrupted one) was finished.
	TriggerResume Trigger = "Resume"
)

// Result of a rotation in history.
type Result string

// Results.
const (
	ResultRunning   Result = "Running"
	ResultCompleted Result = "Completed"
	ResultFailed    Result = "Failed"
)

// RotationRecord is one rotation.
type RotationRecord struct {
	// Generation is the spec.rotationGeneration taken when it started.
	Generation int64 `json:"generation"`
	// Triggers say what asked for it (several requests may fold into one rotation).
	Triggers []Trigger `json:"triggers,omitempty"`
	// FirstEditWritten is true once the new key is in the configuration: from then on
	// a restarted controller resumes this rotation and never adds a second key.
	FirstEditWritten bool         `json:"firstEditWritten,omitempty"`
	StartedTime      metav1.Time  `json:"startedTime"`
	CompletionTime   *metav1.Time `json:"completionTime,omitempty"`
	Result           Result       `json:"result"`
	// Key is the key it introduced, once written.
	Key *KeyRef `json:"key,omitempty"`
	// Message is the failure, for a failed rotation.
	Message string `json:"message,omitempty"`
}

// Straggler is an apiserver a stage waits for.
type Straggler struct {
	APIServerID string `json:"apiserverID"`
	Reason      string `json:"reason,omitempty"`
}
