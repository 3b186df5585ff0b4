package state

import (
	"bytes"
	"encoding/base64"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// leakForms are the ways key bytes could show up in text.
func leakForms(key []byte) []string {
	return []string{
		string(key),
		hex.EncodeToString(key), strings.ToUpper(hex.EncodeToString(key)),
		base64.StdEncoding.EncodeToString(key), base64.RawStdEncoding.EncodeToString(key),
		base64.URLEncoding.EncodeToString(key),
		fmt.Sprint([]byte(key)), // [65 66 ...]
		fmt.Sprintf("%#v", []byte(key)),
		fmt.Sprintf("%q", key),
	}
}

// TestSecretsNeverPrint formats every exported value that holds a plaintext DEK source
// with the usual verbs and json.Marshal; none may show the key bytes in any encoding.
func TestSecretsNeverPrint(t *testing.T) {
	key := bytes.Repeat([]byte{0xA7, 'k', 0x13, 'Z'}, 8) // 32 bytes, printable and not
	ws := &WriteState{Generation: 3, KeyID: "kid", Type: wire.SourceHKDFSeed, Ciphertext: []byte("wrapped"), Source: key, Expiry: time.Unix(1, 0)}
	values := map[string]any{
		"Secret":        Secret(key),
		"WriteState":    *ws,
		"*WriteState":   ws,
		"EncryptResult": EncryptResult{Seq: 1, Source: key, KeyID: "kid", Ciphertext: []byte("wrapped")},
		"View":          View{Write: ws, CanWrite: true},
	}
	verbs := []string{"%v", "%+v", "%#v", "%s", "%q", "%x", "%X", "%d"}
	for name, v := range values {
		var outs []string
		for _, verb := range verbs {
			outs = append(outs, verb+" → "+fmt.Sprintf(verb, v))
		}
		if j, err := json.Marshal(v); err != nil {
			t.Errorf("%s: json.Marshal: %v", name, err)
		} else {
			outs = append(outs, "json → "+string(j))
		}
		for _, out := range outs {
			for _, form := range leakForms(key) {
				if strings.Contains(out, form) {
					t.Errorf("%s: %s shows the key (%q)", name, out, form)
				}
			}
		}
	}
	// The redacted form still says something useful.
	if got := fmt.Sprintf("%v", Secret(key)); got != "<redacted 32 bytes>" {
		t.Errorf("%%v of a Secret = %q", got)
	}
}
