package config

import (
	"testing"

	"k8s.io/apiserver/pkg/apis/apiserver"
)

// TestDefaultKMSTimeoutIsUpstreamDefault: the constant every other package falls back
// on must be what decoding a kms provider without `timeout` yields, or a configuration
// built in code would time out differently from the same one read from a file.
func TestDefaultKMSTimeoutIsUpstreamDefault(t *testing.T) {
	cfg, err := Parse([]byte(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
  - resources: [secrets]
    providers:
      - kms: {apiVersion: v2, name: plug, endpoint: unix:///tmp/plug.sock}
`), "test", Options{})
	if err != nil {
		t.Fatal(err)
	}
	kms := cfg.Encryption.Resources[0].Providers[0].KMS
	if kms.Timeout == nil || kms.Timeout.Duration != DefaultKMSTimeout {
		t.Fatalf("decoded timeout %v, DefaultKMSTimeout %s", kms.Timeout, DefaultKMSTimeout)
	}
	if got := KMSTimeout(kms); got != DefaultKMSTimeout {
		t.Fatalf("KMSTimeout = %s", got)
	}
	if got := KMSTimeout(&apiserver.KMSConfiguration{}); got != DefaultKMSTimeout {
		t.Fatalf("KMSTimeout of an unset timeout = %s", got)
	}
}
