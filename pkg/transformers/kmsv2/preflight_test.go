package kmsv2

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// TestPreflight runs Preflight against a real plugin on a unix socket, healthy and with
// each fault a new configuration must be refused for.
func TestPreflight(t *testing.T) {
	tp := startPlugin(t, "k1")
	dead := "unix://" + filepath.Join(tp.dir, "nobody-listens.sock")
	for _, tc := range []struct {
		name     string
		endpoint string
		faults   kmsplugin.Faults
		timeout  time.Duration
		stage    PreflightStage
		detail   string
	}{
		{name: "healthy", endpoint: tp.endpoint},
		{name: "dead socket", endpoint: dead, stage: PreflightDial, detail: "no such file"},
		{name: "unhealthy", endpoint: tp.endpoint, faults: kmsplugin.Faults{StatusHealthz: "keyring locked"}, stage: PreflightStatus, detail: "keyring locked"},
		{name: "no key id", endpoint: tp.endpoint, faults: kmsplugin.Faults{StatusNoKeyID: true}, stage: PreflightNoKeyID},
		{name: "encrypt fails", endpoint: tp.endpoint, faults: kmsplugin.Faults{FailEncrypt: true}, stage: PreflightEncrypt, detail: "injected fault"},
		{name: "decrypt fails", endpoint: tp.endpoint, faults: kmsplugin.Faults{FailDecrypt: true}, stage: PreflightDecrypt, detail: "injected fault"},
		{name: "wrong plaintext", endpoint: tp.endpoint, faults: kmsplugin.Faults{DecryptWrongPlaintext: true}, stage: PreflightMismatch},
		{name: "slow", endpoint: tp.endpoint, faults: kmsplugin.Faults{Latency: kmsplugin.Duration{Duration: time.Second}}, timeout: 100 * time.Millisecond, stage: PreflightTimeout, detail: "after 100ms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			tp.SetFaults(tc.faults)
			defer tp.SetFaults(kmsplugin.Faults{})
			timeout := 3 * time.Second
			if tc.timeout > 0 {
				timeout = tc.timeout
			}
			err := Preflight(context.Background(), "kms1", tc.endpoint, timeout)
			if tc.stage == "" {
				if err != nil {
					t.Fatalf("a healthy plugin failed the preflight: %v", err)
				}
				return
			}
			var pe *PreflightError
			if !errors.As(err, &pe) {
				t.Fatalf("got %v, want a *PreflightError at %q", err, tc.stage)
			}
			msg := err.Error()
			if pe.Stage != tc.stage || !strings.Contains(msg, tc.detail) || !strings.Contains(msg, `"kms1"`) || !strings.Contains(msg, tc.endpoint) {
				t.Fatalf("got %q (stage %q), want stage %q mentioning %q, the provider and the endpoint", msg, pe.Stage, tc.stage, tc.detail)
			}
		})
	}
}
