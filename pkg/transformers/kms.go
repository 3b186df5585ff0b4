package transformers

import "time"

// KMSStatus describes a KMS v2 provider for health and status output. It carries the
// key id only as its "sha256:<hex>" hash, never key material.
type KMSStatus struct {
	// Name is the provider name from the config.
	Name string `json:"name"`
	// Endpoint is the plugin address from the config.
	Endpoint string `json:"endpoint"`
	// Healthy is the result of the latest Status call.
	Healthy bool `json:"healthy"`
	// LastError is the latest failure, empty when healthy.
	LastError string `json:"lastError,omitempty"`
	// KeyIDHash is "sha256:<hex>" of the key id new values are written under.
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// DEKSourceType is the type of the write DEK source (HKDF_SHA256_XNONCE_AES_GCM_SEED or AES_GCM_KEY).
	DEKSourceType string `json:"dekSourceType,omitempty"`
	// WriteExpiry is when writes stop being allowed unless a healthy Status arrives first.
	WriteExpiry time.Time `json:"writeExpiry,omitzero"`
	// LastStatus is when the plugin last answered Status.
	LastStatus time.Time `json:"lastStatus,omitzero"`
}
