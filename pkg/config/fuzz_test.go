package config_test

import (
	"encoding/base64"
	"regexp"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/configtest"
	"github.com/rekey-io/rekey/pkg/config"
)

// FuzzParse: any input either parses into a validated config or returns an error that
// names the source and quotes none of the input's secrets; it never panics.
func FuzzParse(f *testing.F) {
	for _, tc := range validationTable {
		f.Add([]byte(tc.data))
	}
	for _, tc := range configtest.SecretEcho() {
		f.Add([]byte(tc.Data))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := config.Parse(data, "fuzz.yaml", config.Options{Reload: true})
		if err != nil {
			if !strings.Contains(err.Error(), "fuzz.yaml") {
				t.Fatalf("error does not name the source: %v", err)
			}
			for _, s := range secretsIn(string(data)) {
				if strings.Contains(err.Error(), s) {
					t.Fatalf("error quotes the secret %q from the input: %v", s, err)
				}
			}
			return
		}
		if cfg.Encryption == nil || len(cfg.Encryption.Resources) == 0 || cfg.Hash != config.Hash(data) {
			t.Fatalf("accepted config is incomplete: %+v", cfg)
		}
	})
}

var (
	// secretValue finds `secret: <value>` in YAML and `"secret": "<value>"` in JSON,
	// quoted or not, and stops at what ends a flow-style scalar.
	secretValue = regexp.MustCompile(`"?secret"?\s*:\s*(?:![^\s]*\s+)?['"]?([^'"\s,}\]]+)`)
	// valueToken finds a `key: value` pair; base64Token the base64 runs in the value.
	valueToken  = regexp.MustCompile(`([A-Za-z0-9+/=_"-]*)\s*:\s*(?:![^\s]*\s+)?['"]?([^'"\s,}\]]+)`)
	base64Token = regexp.MustCompile(`[A-Za-z0-9+/]{16,}={0,2}`)
)

// shownOnPurpose are fields whose values errors quote by design: key and KMS names and
// endpoints say which entry is wrong, kind and apiVersion which document it is.
var shownOnPurpose = map[string]bool{"name": true, "endpoint": true, "kind": true, "apiVersion": true}

// secretsIn returns what in data may be key material: every `secret:` value of at least
// 8 characters, and every value that holds a base64 token of at least 16 characters that
// decodes and is not made of letters only (field and kind names are; random keys
// practically never are).
func secretsIn(data string) []string {
	var out []string
	for _, m := range secretValue.FindAllStringSubmatch(data, -1) {
		if len(m[1]) >= 8 {
			out = append(out, m[1])
		}
	}
	for _, m := range valueToken.FindAllStringSubmatch(data, -1) {
		toks := base64Token.FindAllString(m[1], -1) // keys: a pasted key can become a field name
		if !shownOnPurpose[strings.Trim(m[1], `"`)] {
			toks = append(toks, base64Token.FindAllString(m[2], -1)...)
		}
		for _, tok := range toks {
			if strings.Trim(tok, "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz") == "" {
				continue
			}
			if _, err := base64.StdEncoding.DecodeString(tok); err == nil {
				out = append(out, tok)
			} else if _, err := base64.RawStdEncoding.DecodeString(tok); err == nil {
				out = append(out, tok)
			}
		}
	}
	return out
}

// TestSecretsInFindsTheTableSecrets keeps the fuzz oracle honest: it must recognise the
// secrets the secret-echo table plants.
func TestSecretsInFindsTheTableSecrets(t *testing.T) {
	for _, tc := range configtest.SecretEcho() {
		found := secretsIn(tc.Data)
		for _, s := range tc.Secrets {
			ok := false
			for _, f := range found {
				if strings.Contains(s, f) || strings.Contains(f, s) {
					ok = true
				}
			}
			if !ok {
				t.Errorf("%s: the fuzz oracle misses %q (found %q)", tc.Name, s, found)
			}
		}
	}
}
