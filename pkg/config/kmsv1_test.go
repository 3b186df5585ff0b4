package config_test

import (
	"strings"
	"testing"

	"github.com/rekey-io/rekey/pkg/config"
)

// A KMS v1 provider is read, never written: in the write position it is refused with
// words that say what to do and never send the operator to a --feature-gates flag no
// rekey binary has; behind a writer (or in a later entry that only appends readers) it
// is valid.
func TestKMSv1OnlyBehindAWriter(t *testing.T) {
	const v1 = "      - kms:\n          name: old\n          endpoint: unix:///tmp/x.sock\n"
	const gcm = "      - aesgcm:\n          keys: [{name: k, secret: " + key32 + "}]\n"
	for _, tc := range []struct {
		name  string
		data  string
		valid bool
	}{
		{name: "v1 alone", data: doc("  - resources: [secrets]\n    providers:\n" + v1)},
		{name: "v1 first", data: doc("  - resources: [secrets]\n    providers:\n" + v1 + gcm)},
		{name: "v1 first for a resource of its own", data: doc("  - resources: [secrets]\n    providers:\n" + gcm + "  - resources: [configmaps, secrets]\n    providers:\n" + v1)},
		{name: "v1 behind aesgcm", data: doc("  - resources: [secrets]\n    providers:\n" + gcm + v1), valid: true},
		{name: "v1 behind kms v2", data: doc("  - resources: [secrets]\n    providers:\n" + kmsV2("new", "") + v1), valid: true},
		{name: "v1 appended by a later entry", data: doc("  - resources: [secrets]\n    providers:\n" + gcm + "  - resources: [secrets]\n    providers:\n" + v1), valid: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg, err := config.Parse([]byte(tc.data), "enc.yaml", config.Options{})
			if tc.valid {
				if err != nil {
					t.Fatalf("a KMS v1 provider behind a writer is refused: %v", err)
				}
				if cfg.Encryption == nil {
					t.Fatal("no configuration")
				}
				return
			}
			if err == nil {
				t.Fatal("a KMS v1 provider in the write position was accepted")
			}
			for _, want := range []string{config.KMSv1ReadOnlyError, "apiVersion: v2", "aesgcm", "after it", "rekey rotate", "rekey migrate", "enc.yaml", "kms.apiVersion"} {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error %q does not say %q", err, want)
				}
			}
			if strings.Contains(err.Error(), "--feature-gates") {
				t.Errorf("error %q points to a feature gate", err)
			}
		})
	}
}
