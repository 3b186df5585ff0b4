// Package configtest holds test inputs shared by the packages that load encryption
// configurations (pkg/config, pkg/reload, cmd/rekey): malformed files that carry
// recognisable secrets, and a check that a text does not repeat them.
package configtest

import (
	"encoding/base64"
	"encoding/hex"
	"strings"
)

// Secrets used by SecretEcho. Each is unique so a leak names its case; each is the
// base64 of random-looking bytes, the shape a real key has.
const (
	Secret32      = "c2VjcmV0IGlzIHNlY3VyZSwgaXMgaXQ/IHllcyBpdCE=" // 32 bytes
	Secret32b     = "dGhlIG90aGVyIGtleSBpcyBzZWNyZXQgdG9vLCBvayE=" // 32 bytes
	Secret31      = "c2VjcmV0IGlzIHNlY3VyZSwgaXMgaXQ/IHllcyBpdA==" // 31 bytes: wrong length everywhere
	SecretNotB64  = "bm90IGJhc2U2NCBidXQgc2VjcmV0*!c2VjcmV0IGtleQ" // not base64
	SecretForTags = "dGFnZ2VkIGFzIGFuIGludGVnZXIsIHN0aWxsIHNlY3Jl" // 33 bytes
)

// SecretEchoCase is one malformed configuration and the secrets it contains.
type SecretEchoCase struct {
	Name    string
	Data    string
	Secrets []string
}

func doc(resources string) string {
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" + resources
}

// SecretEcho is the secret-echo table: every case is rejected, and before redaction
// each of them made the error quote a secret (upstream renders a whole provider, keys
// included, when a list element names two providers; YAML errors quote tagged values
// and map keys).
func SecretEcho() []SecretEchoCase {
	return []SecretEchoCase{
		{
			Name:    "missing-dash typo (two providers in one element)",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, secret: " + Secret32 + "}]\n        identity: {}\n"),
			Secrets: []string{Secret32},
		},
		{
			Name:    "missing-dash typo, key list in block style",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - identity: {}\n        secretbox:\n          keys:\n            - name: k1\n              secret: " + Secret32 + "\n            - name: k2\n              secret: " + Secret32b + "\n"),
			Secrets: []string{Secret32, Secret32b},
		},
		{
			Name:    "null map key with the secret as its value",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, ~: " + Secret32 + "}]\n"),
			Secrets: []string{Secret32},
		},
		{
			Name:    "complex map key holding the secret",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, ? {secret: " + Secret32 + "} : x}]\n"),
			Secrets: []string{Secret32},
		},
		{
			Name:    "!!int tag on a secret",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, secret: !!int " + SecretForTags + "}]\n"),
			Secrets: []string{SecretForTags},
		},
		{
			Name:    "!!float tag on a secret",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys:\n            - name: k1\n              secret: !!float " + SecretForTags + "\n"),
			Secrets: []string{SecretForTags},
		},
		{
			Name:    "invalid base64 secret in a two-provider element",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: k1, secret: '" + SecretNotB64 + "'}]\n        identity: {}\n"),
			Secrets: []string{SecretNotB64},
		},
		{
			Name:    "invalid base64 secret",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aescbc:\n          keys: [{name: k1, secret: '" + SecretNotB64 + "'}]\n"),
			Secrets: []string{SecretNotB64},
		},
		{
			Name:    "wrong key length in a two-provider element",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - secretbox:\n          keys: [{name: k1, secret: " + Secret31 + "}]\n        aesgcm:\n          keys: [{name: k2, secret: " + Secret32 + "}]\n"),
			Secrets: []string{Secret31, Secret32},
		},
		{
			Name:    "wrong key length",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - secretbox:\n          keys: [{name: k1, secret: " + Secret31 + "}]\n"),
			Secrets: []string{Secret31},
		},
		{
			Name:    "duplicate key names in a two-provider element",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, secret: " + Secret32 + "}, {name: k1, secret: " + Secret32b + "}]\n        identity: {}\n"),
			Secrets: []string{Secret32, Secret32b},
		},
		{
			Name:    "duplicate secret field",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, secret: " + Secret32 + ", secret: " + Secret32b + "}]\n"),
			Secrets: []string{Secret32, Secret32b},
		},
		{
			Name:    "duplicate KMS names next to a typo'd element",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - kms: {apiVersion: v2, name: dup, endpoint: 'unix:///tmp/rekey-absent.sock'}\n      - kms: {apiVersion: v2, name: dup, endpoint: 'unix:///tmp/rekey-absent.sock'}\n        aesgcm:\n          keys: [{name: k1, secret: " + Secret32 + "}]\n"),
			Secrets: []string{Secret32},
		},
		{
			Name:    "secret pasted as a field name",
			Data:    doc("  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys: [{name: k1, " + Secret32 + ": x}]\n"),
			Secrets: []string{Secret32},
		},
	}
}

// Leaks returns the forms of secrets (the base64 text, any 16-character piece of it,
// and the decoded bytes raw, as hex and as base64 without padding) found in text.
func Leaks(text string, secrets ...string) []string {
	var found []string
	for _, s := range secrets {
		forms := []string{s}
		for i := 0; i+16 <= len(s); i += 8 {
			forms = append(forms, s[i:i+16])
		}
		if raw, err := base64.StdEncoding.DecodeString(s); err == nil && len(raw) >= 8 {
			forms = append(forms, string(raw), hex.EncodeToString(raw), base64.RawStdEncoding.EncodeToString(raw))
		}
		for _, f := range forms {
			if strings.Contains(text, f) {
				found = append(found, f)
				break
			}
		}
	}
	return found
}
