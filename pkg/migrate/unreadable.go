package migrate

import (
	"errors"
	"strings"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// Unreadable error classes: the closed set of reasons an inventory can tell apart
// without key material. They say what an operator can do, not how a provider failed.
const (
	// ClassUnknownKey: no provider of the resource's rule has the stored prefix (the key
	// was removed, or the value was written by another configuration).
	ClassUnknownKey = "unknown-key"
	// ClassCorrupt: the prefix is one the rule reads, but the value behind it cannot be
	// parsed (a KMS v2 envelope that does not decode).
	ClassCorrupt = "corrupt"
	// ClassDecryptFailed: a provider with the stored prefix failed to decrypt it (a key
	// of the same name with another secret, a KMS plugin that no longer has the key id,
	// or tampered bytes).
	ClassDecryptFailed = "decrypt-failed"
	// ClassNotAnObject: the value decrypts, but not to a stored Kubernetes object (read
	// with a wrong key that happened to authenticate, e.g. aescbc).
	ClassNotAnObject = "not-a-kubernetes-object"
)

// UnreadableObject names one stored object the configuration cannot read. It holds the
// etcd key, the stored prefix and a class, never the value or key material.
type UnreadableObject struct {
	// Key is the etcd key; Namespace and Name are read from it ("" namespace for a
	// cluster-scoped resource).
	Key       string `json:"key"`
	Namespace string `json:"namespace,omitempty"`
	Name      string `json:"name"`
	// Prefix is the stored prefix ("identity" for a value without one).
	Prefix string `json:"prefix"`
	// Class is one of the Class* constants.
	Class string `json:"class"`
	// ModRevision is the value's etcd mod revision: an acknowledgement holds only for it.
	ModRevision int64 `json:"modRevision"`
	// Acknowledged is set when an operator acknowledged this very value.
	Acknowledged bool `json:"acknowledged,omitempty"`
}

// objectName splits an etcd key under res's key prefix into namespace and name:
// "<prefix><ns>/<name>", or "<prefix><name>" for a cluster-scoped resource.
func objectName(res Resource, key string) (namespace, name string) {
	rest := strings.TrimPrefix(key, res.KeyPrefix)
	if ns, n, ok := strings.Cut(rest, "/"); ok {
		return ns, n
	}
	return "", rest
}

// objectKey is objectName's inverse: the etcd key of namespace/name of res.
func objectKey(res Resource, namespace, name string) string {
	if namespace == "" {
		return res.KeyPrefix + name
	}
	return res.KeyPrefix + namespace + "/" + name
}

// storedPrefixName is the prefix as an inventory lists it: "identity" for a value
// without one.
func storedPrefixName(b Bucket) string {
	if b.Prefix == "" {
		return transformers.ProviderIdentity
	}
	return b.Prefix
}

// unreadableClass classifies why a value of bucket b is unreadable; decryptErr is the
// transformers' error when the value was decrypted (nil when only its prefix was
// looked at). readable says whether the rule has a provider with b's prefix.
func unreadableClass(b Bucket, readable bool, decryptErr error) string {
	switch {
	case errors.Is(decryptErr, errNotAnObject):
		return ClassNotAnObject
	case !readable:
		return ClassUnknownKey
	case b.Provider == transformers.ProviderKMSv2 && b.KeyIDHash == "":
		return ClassCorrupt
	default:
		return ClassDecryptFailed
	}
}
