package testbed

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"slices"
	"strings"

	"sigs.k8s.io/yaml"
)

// Provider is one provider entry of an EncryptionConfiguration, in a form the
// testbed can render and edit (drop a key) without parsing YAML.
type Provider struct {
	// Type is aesgcm, aescbc, secretbox, kms or identity.
	Type string
	// Keys are the named keys of aesgcm, aescbc and secretbox.
	Keys []NamedKey
	// Name and Endpoint are a KMS v2 provider's.
	Name, Endpoint string
}

// NamedKey is a local key: its name and base64 secret.
type NamedKey struct{ Name, Secret string }

// AESGCM is an aesgcm provider with the keys in order (the first one writes).
func AESGCM(keys ...NamedKey) Provider { return Provider{Type: "aesgcm", Keys: keys} }

// KMSv2 is a KMS v2 provider.
func KMSv2(name, endpoint string) Provider {
	return Provider{Type: "kms", Name: name, Endpoint: endpoint}
}

// Identity is the identity (plaintext) provider.
func Identity() Provider { return Provider{Type: "identity"} }

// ResourceConfig is one resources entry: the resources and their providers in
// order (the first one writes).
type ResourceConfig struct {
	Resources []string
	Providers []Provider
}

// EncryptionConfig is an EncryptionConfiguration.
type EncryptionConfig []ResourceConfig

// SecretsConfig is a configuration of secrets only.
func SecretsConfig(providers ...Provider) EncryptionConfig {
	return EncryptionConfig{{Resources: []string{"secrets"}, Providers: providers}}
}

// Render writes the configuration as the YAML file kube-apiserver reads.
func (c EncryptionConfig) Render() []byte {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n")
	for _, r := range c {
		fmt.Fprintf(&b, "- resources: [%s]\n  providers:\n", strings.Join(r.Resources, ", "))
		for _, p := range r.Providers {
			switch p.Type {
			case "identity":
				b.WriteString("  - identity: {}\n")
			case "kms":
				fmt.Fprintf(&b, "  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: %s\n      timeout: 2s\n", p.Name, p.Endpoint)
			default:
				fmt.Fprintf(&b, "  - %s:\n      keys:\n", p.Type)
				for _, k := range p.Keys {
					fmt.Fprintf(&b, "      - {name: %s, secret: %q}\n", k.Name, k.Secret)
				}
			}
		}
	}
	return []byte(b.String())
}

// WithoutKey returns the configuration with every local key named keyName removed
// (and a provider left without keys removed), as an operator drops an old key once
// nothing is stored under it.
func (c EncryptionConfig) WithoutKey(keyName string) EncryptionConfig {
	out := make(EncryptionConfig, 0, len(c))
	for _, r := range c {
		nr := ResourceConfig{Resources: slices.Clone(r.Resources)}
		for _, p := range r.Providers {
			if p.Type == "identity" || p.Type == "kms" {
				nr.Providers = append(nr.Providers, p)
				continue
			}
			np := p
			np.Keys = slices.DeleteFunc(slices.Clone(p.Keys), func(k NamedKey) bool { return k.Name == keyName })
			if len(np.Keys) > 0 {
				nr.Providers = append(nr.Providers, np)
			}
		}
		out = append(out, nr)
	}
	return out
}

// WithoutKMS returns the configuration without the KMS v2 provider named name.
func (c EncryptionConfig) WithoutKMS(name string) EncryptionConfig {
	out := make(EncryptionConfig, 0, len(c))
	for _, r := range c {
		nr := ResourceConfig{Resources: slices.Clone(r.Resources)}
		for _, p := range r.Providers {
			if p.Type != "kms" || p.Name != name {
				nr.Providers = append(nr.Providers, p)
			}
		}
		out = append(out, nr)
	}
	return out
}

// ConfigHash is the hash the status document reports as activeConfigHash for a file
// with content.
func ConfigHash(content []byte) string {
	h := sha256.Sum256(content)
	return "sha256:" + hex.EncodeToString(h[:])
}

// AESGCMKeyNames lists the key names of a config's aesgcm providers in order (no
// secrets): what a rotation test or benchmark checks of the file it edited.
func AESGCMKeyNames(content []byte) ([]string, error) {
	var cfg struct {
		Resources []struct {
			Providers []struct {
				AESGCM *struct {
					Keys []struct {
						Name string `json:"name"`
					} `json:"keys"`
				} `json:"aesgcm"`
			} `json:"providers"`
		} `json:"resources"`
	}
	if err := yaml.Unmarshal(content, &cfg); err != nil {
		return nil, fmt.Errorf("reading the encryption config: %w", err)
	}
	var out []string
	for _, r := range cfg.Resources {
		for _, p := range r.Providers {
			if p.AESGCM != nil {
				for _, k := range p.AESGCM.Keys {
					out = append(out, k.Name)
				}
			}
		}
	}
	return out, nil
}
