// Package v1alpha1 is rekey's own API, group rekey.io, version v1alpha1: the
// ControlPlaneEncryption object, one per managed control plane, on which a platform
// declares the rotation of that control plane's encryption-at-rest key (a bumped
// spec.rotationGeneration, a rotationPeriod, a write budget, or the one-shot annotation
// rekey.io/operation=rotate) and reads how it goes (status). `rekey controller`
// reconciles these objects by running the rotation `rekey rotate --wait --secret` runs.
//
// The status never holds key material: keys are named by provider, name and a
// fingerprint (a local key's check value, a KMS v2 key id's hash).
//
// Nothing here registers itself anywhere: AddToScheme adds the types to the scheme the
// caller builds.
//
// EncryptionState (encryptionstate.go) is what the apiservers report of etcd; the
// apiserver shim serves it with OpenAPI definitions generated from these types
// (hack/update-openapi.sh).
//
// +k8s:openapi-gen=true
package v1alpha1
