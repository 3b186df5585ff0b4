package config_test

import (
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/config"
)

// A binary that also parses kube-apiserver's --feature-gates must not tell the operator
// to set KMSv1=true: that gate does not bring KMS v1 back to rekey.
func TestKMSv1ErrorOverride(t *testing.T) {
	data := []byte(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
  - resources: [secrets]
    providers:
      - kms:
          name: old
          endpoint: unix:///tmp/x.sock
`)
	_, err := config.Parse(data, "enc.yaml", config.Options{})
	if err == nil || !strings.Contains(err.Error(), "--feature-gates=KMSv1=true") {
		t.Fatalf("default: got %v, want upstream's words", err)
	}
	_, err = config.Parse(data, "enc.yaml", config.Options{KMSv1Error: config.KMSv1UnsupportedError})
	if err == nil || !strings.Contains(err.Error(), config.KMSv1UnsupportedError) {
		t.Fatalf("override: got %v, want %q", err, config.KMSv1UnsupportedError)
	}
	if strings.Contains(err.Error(), "--feature-gates=KMSv1=true") {
		t.Fatalf("override still points to the KMSv1 feature gate: %v", err)
	}
}
