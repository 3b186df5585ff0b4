// Package kmsv1 reads values that kube-apiserver wrote with a KMS v1 provider, so that
// clusters created before KMS v2 can migrate off it. It never writes: a KMS v1 provider
// is only valid behind a provider that writes (pkg/config refuses it in the write
// position), and Seal fails.
//
// The stored form is upstream's v1 envelope (k8s.io/apiserver/pkg/storage/value/
// encrypt/envelope):
//
//	k8s:enc:kms:v1:<name>: ‖ uint16 big-endian length n ‖ encrypted DEK (n bytes) ‖ data
//
// The plugin's Decrypt (k8s.io/kms/apis/v1beta1, over the unix socket the
// configuration names, bounded by its `timeout`) unwraps the DEK; data is AES-GCM
// under the DEK (nonce(12) ‖ ciphertext ‖ tag, the etcd key as authenticated data),
// as Kubernetes 1.25 and later write it, or AES-CBC (IV(16) ‖ PKCS#7-padded
// ciphertext, no authenticated data), as Kubernetes 1.24 and earlier wrote it.
// Nothing in the value says which: like upstream, a read tries GCM, then CBC, and a
// value read with CBC is stale. Unwrapped DEKs are kept in a bounded LRU cache (the
// provider's `cachesize`, 1000 by default; a negative size disables it, as upstream),
// keyed by the encrypted DEK, so reads of values sharing a DEK call the plugin once.
//
// # Key identity
//
// A KMS v1 plugin has no key id: neither Version nor Decrypt says which
// key-encryption key it holds, and the stored prefix names only the provider. What a
// configuration can state about the key is therefore the provider name (what the
// values carry) and the endpoint (which plugin unwraps them): pkg/transformers
// identifies a KMS v1 key by both (KMSv1Fingerprint; the endpoint as the socket it
// dials, so unix:/x and unix:///x are one). Two entries with one name and different
// sockets may be two plugins with different keys, and nothing can prove otherwise, so
// they are not the same key: the guard refuses to move a v1 provider to another socket
// while values under it remain, as it refuses to replace a local key's secret.
//
// Errors of the plugin keep their gRPC status (Unavailable and DeadlineExceeded when
// it is down), so storage migration retries them instead of counting values
// unreadable, as it does for KMS v2.
package kmsv1
