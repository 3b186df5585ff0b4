package kmsv2

import (
	"bytes"
	"encoding/hex"
	"fmt"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// TestDEKEntryNeverPrints: the cached plaintext seed stays redacted when a cache entry
// (or a value holding one) is formatted, e.g. by a debug log.
func TestDEKEntryNeverPrints(t *testing.T) {
	seed := bytes.Repeat([]byte{0xC3, 's', 0x5A, 0x01}, 8)
	e, err := newDEKEntry(wire.SourceHKDFSeed, seed, false)
	if err != nil {
		t.Fatal(err)
	}
	for _, verb := range []string{"%v", "%+v", "%#v", "%s", "%q", "%x"} {
		out := fmt.Sprintf(verb, e) + fmt.Sprintf(verb, *e)
		for _, form := range []string{string(seed), hex.EncodeToString(seed), fmt.Sprint(seed)[1:20]} {
			if strings.Contains(out, form) {
				t.Errorf("%s of a DEK cache entry shows the seed: %s", verb, out)
			}
		}
	}
}
