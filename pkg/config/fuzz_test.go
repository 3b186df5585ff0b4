package config_test

import (
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/config"
)

// FuzzParse: any input either parses into a validated config or returns an error that
// names the source; it never panics.
func FuzzParse(f *testing.F) {
	for _, tc := range validationTable {
		f.Add([]byte(tc.data))
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		cfg, err := config.Parse(data, "fuzz.yaml", config.Options{Reload: true})
		if err != nil {
			if !strings.Contains(err.Error(), "fuzz.yaml") {
				t.Fatalf("error does not name the source: %v", err)
			}
			return
		}
		if cfg.Encryption == nil || len(cfg.Encryption.Resources) == 0 || cfg.Hash != config.Hash(data) {
			t.Fatalf("accepted config is incomplete: %+v", cfg)
		}
	})
}
