package bench

import (
	"crypto/rand"
	"encoding/base64"
	"fmt"
)

// randomKey is a base64 key of n random bytes, as an EncryptionConfiguration holds it.
func randomKey(n int) string {
	k := make([]byte, n)
	_, _ = rand.Read(k)
	return base64.StdEncoding.EncodeToString(k)
}

// LocalProviderYAML is a one-provider config for resource secrets.
func LocalProviderYAML(provider string) string {
	var p string
	switch provider {
	case "identity":
		p = "      - identity: {}\n"
	default:
		p = fmt.Sprintf("      - %s:\n          keys:\n            - {name: key1, secret: %s}\n", provider, randomKey(32))
	}
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" + p
}

// kmsThenIdentityConfig encrypts Secrets with the KMS v2 plugin at endpoint (provider
// "bench") and still reads plaintext ones: the apiserver scenarios' config.
func kmsThenIdentityConfig(endpoint string) string {
	return fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
  - resources: [secrets]
    providers:
      - kms:
          apiVersion: v2
          name: bench
          endpoint: %s
          timeout: 3s
      - identity: {}
`, endpoint)
}
