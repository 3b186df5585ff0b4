package kmsplugin

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/rekey-io/rekey/internal/configtest"
)

// TestKeysFileErrorsNeverEchoSecrets: a malformed keys file is refused, at start and
// through Status after a bad edit, without quoting its secrets (the YAML parser's
// messages quote tagged values, odd map keys and unknown field names).
func TestKeysFileErrorsNeverEchoSecrets(t *testing.T) {
	const s = configtest.Secret32
	cases := map[string]string{
		"!!int tag":              "keys:\n- name: k1\n  secret: !!int " + s + "\n",
		"!!float tag":            "keys: [{name: k1, secret: !!float " + s + "}]\n",
		"null key":               "keys: [{name: k1, ~: " + s + "}]\n",
		"complex key":            "keys: [{name: k1, ? {secret: " + s + "} : x}]\n",
		"secret as a field name": "keys: [{name: k1, " + s + ": x}]\n",
		"secret as a list item":  "keys: [" + s + "]\n",
		"wrong length":           "keys: [{name: k1, secret: " + configtest.Secret31 + "}]\n",
		"not base64":             "keys: [{name: k1, secret: '" + configtest.SecretNotB64 + "'}]\n",
	}
	dir := t.TempDir()
	for name, data := range cases {
		t.Run(name, func(t *testing.T) {
			_, err := parseKeys([]byte(data))
			if err == nil {
				t.Fatal("parseKeys accepted a malformed keys file")
			}
			if leaks := configtest.Leaks(err.Error(), s, configtest.Secret31, configtest.SecretNotB64); len(leaks) > 0 {
				t.Fatalf("error quotes a secret (%q): %v", leaks, err)
			}
			path := filepath.Join(dir, "keys.yaml")
			if err := os.WriteFile(path, []byte(data), 0o600); err != nil {
				t.Fatal(err)
			}
			if _, err := NewPlugin(path); err == nil {
				t.Fatal("NewPlugin accepted a malformed keys file")
			} else if leaks := configtest.Leaks(err.Error(), s, configtest.Secret31, configtest.SecretNotB64); len(leaks) > 0 {
				t.Fatalf("NewPlugin error quotes a secret (%q): %v", leaks, err)
			}
			t.Log(err)
		})
	}
}
