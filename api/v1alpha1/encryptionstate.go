package v1alpha1

import (
	_ "embed"
	"slices"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// Kind and resource of the encryption-state API: what etcd holds, as the migration
// leader last counted it. Cluster-scoped and read-only: the apiservers write it, users
// get, list and watch it (docs/encryption-state.md).
const (
	EncryptionStateKind     = "EncryptionState"
	EncryptionStateListKind = "EncryptionStateList"
	EncryptionStateResource = "encryptionstates"
	// EncryptionStateName is the one object there is: the cluster's.
	EncryptionStateName = "cluster"
)

// EncryptionStateGroupVersionResource is rekey.io/v1alpha1 encryptionstates.
func EncryptionStateGroupVersionResource() schema.GroupVersionResource {
	return SchemeGroupVersion.WithResource(EncryptionStateResource)
}

// EncryptionState is the cluster's encryption at rest as stored: per resource, which
// keys hold how many objects, what is plaintext or unreadable; per apiserver, the
// configuration it runs. It holds names, counts, check values and "sha256:" key id
// hashes, never key material.
type EncryptionState struct {
	metav1.TypeMeta   `json:",inline"`
	metav1.ObjectMeta `json:"metadata,omitempty"`

	Status EncryptionStateStatus `json:"status,omitempty"`
}

// EncryptionStateList is a list of EncryptionState.
type EncryptionStateList struct {
	metav1.TypeMeta `json:",inline"`
	metav1.ListMeta `json:"metadata,omitempty"`
	Items           []EncryptionState `json:"items"`
}

// EncryptionStateStatus is the state one apiserver, the migration leader, observed.
type EncryptionStateStatus struct {
	// ObservedBy is the apiserver (its member id) that wrote this state.
	ObservedBy string `json:"observedBy"`
	// ClusterID is the cluster identity under the coordination prefix ("" without).
	ClusterID string `json:"clusterID,omitempty"`
	// ConfigHash is the configuration the stored values were classified against: the
	// writer's.
	ConfigHash string `json:"configHash"`
	// FIPS is the writer's FIPS 140-3 mode: off, on or only.
	FIPS string `json:"fips"`
	// DecryptChecked is true when the inventories also decrypted every value, so that
	// Unreadable is exact (otherwise it counts values no configured key can name).
	DecryptChecked bool `json:"decryptChecked"`
	// Totals add up Resources.
	Totals EncryptionTotals `json:"totals"`
	// Resources, by name.
	Resources []ResourceEncryptionState `json:"resources,omitempty"`
	// APIServers are the live apiservers, by id.
	APIServers []APIServerEncryptionState `json:"apiservers,omitempty"`
	// Attention lists what an operator should look at; empty when every object is on
	// its write key and every apiserver agrees.
	Attention []string `json:"attention,omitempty"`
}

// EncryptionTotals count objects over every resource.
type EncryptionTotals struct {
	Objects   int64 `json:"objects"`
	Plaintext int64 `json:"plaintext"`
	// Stale counts readable objects not written with their resource's write key.
	Stale int64 `json:"stale"`
	// Unreadable counts objects the configuration cannot read; Acknowledged those of
	// them an operator acknowledged (rekey migrate --acknowledge-unreadable).
	Unreadable   int64 `json:"unreadable"`
	Acknowledged int64 `json:"acknowledged"`
}

// ResourceEncryptionState is one resource's stored objects per key.
type ResourceEncryptionState struct {
	// Resource is "secrets", "configmaps", "widgets.example.com".
	Resource string `json:"resource"`
	// Revision and InventoryTime are the etcd revision the resource was read at and
	// when its inventory started.
	Revision      int64       `json:"revision"`
	InventoryTime metav1.Time `json:"inventoryTime"`
	// WriteKey is the key new values are written with; ReadKeys every key the
	// configuration reads the resource with, in its order.
	WriteKey KeyRef   `json:"writeKey"`
	ReadKeys []KeyRef `json:"readKeys,omitempty"`
	Objects  int64    `json:"objects"`
	// Plaintext counts objects stored without encryption (identity), whatever the
	// rule writes.
	Plaintext    int64 `json:"plaintext"`
	Stale        int64 `json:"stale"`
	Unreadable   int64 `json:"unreadable"`
	Acknowledged int64 `json:"acknowledged"`
	// Keys are the keys the stored objects are under.
	Keys []StoredKey `json:"keys,omitempty"`
}

// StoredKey is how many objects of a resource one key holds, and how much it was used.
type StoredKey struct {
	// Provider is identity, aesgcm, aescbc, secretbox, kms, kmsv1 or unknown.
	Provider string `json:"provider"`
	// Name is the key's name (local keys) or the KMS provider's name, as stored.
	Name string `json:"name,omitempty"`
	// Fingerprint is a local key's check value, or the KMS v2 key id's "sha256:<hex>"
	// hash; empty for plaintext and for a key the configuration lacks and the key
	// ledger cannot name.
	Fingerprint string `json:"fingerprint,omitempty"`
	// InConfiguration is false for a key the configuration cannot read (retired).
	InConfiguration bool `json:"inConfiguration"`
	// Current is true for the resource's write key.
	Current      bool  `json:"current"`
	Objects      int64 `json:"objects"`
	Unreadable   int64 `json:"unreadable,omitempty"`
	Acknowledged int64 `json:"acknowledged,omitempty"`
	// FirstUse is when an apiserver of the cluster first configured the key; Age is
	// how old it was at the resource's InventoryTime (minutes).
	FirstUse *metav1.Time     `json:"firstUse,omitempty"`
	Age      *metav1.Duration `json:"age,omitempty"`
	// Writes is how many values the cluster sealed with the key; WriteBudget how many
	// it may (aesgcm's 2^32 random nonces; 0: no budget).
	Writes      int64 `json:"writes,omitempty"`
	WriteBudget int64 `json:"writeBudget,omitempty"`
	// Retired is when the key ledger recorded the key leaving the configuration.
	Retired *metav1.Time `json:"retired,omitempty"`
}

// APIServerEncryptionState is one live apiserver's published configuration.
type APIServerEncryptionState struct {
	ID      string `json:"id"`
	Version string `json:"version,omitempty"`
	// ConfigHash is the hash of the configuration it runs; Agrees whether that is the
	// writer's (ConfigHash of the status).
	ConfigHash string `json:"configHash"`
	Agrees     bool   `json:"agrees"`
	// FIPS is on or off as its record says; "" when its record does not say.
	FIPS string `json:"fips,omitempty"`
}

//go:embed encryptionstate-crd.yaml
var encryptionStateCRD []byte

// EncryptionStateCRD is the CustomResourceDefinition of EncryptionState (YAML), for an
// apiserver that serves it through apiextensions (dist/kube-apiserver); a copy.
func EncryptionStateCRD() []byte { return slices.Clone(encryptionStateCRD) }
