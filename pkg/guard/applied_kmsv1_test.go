package guard

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestCheckStartupKMSv1StateOfTheEndpointAsWritten: applied states saved before KMS v1
// fingerprints followed the socket hold the fingerprint of the endpoint as written. After
// an upgrade, a configuration naming the same socket (spelled either way) starts; another
// socket, an entry without an endpoint, or a fingerprint of another endpoint is still
// refused.
func TestCheckStartupKMSv1StateOfTheEndpointAsWritten(t *testing.T) {
	const v1Prefix = "k8s:enc:kms:v1:old:"
	kmsv1Config := func(endpoint string) *config.Config {
		return enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key1")+"      - kms: {name: old, endpoint: '"+endpoint+"'}\n")
	}
	// What rekey saved before the change: sha256 of the name and the endpoint as written.
	spelled := func(name, endpoint string) string {
		fp := transformers.KeyFingerprint(transformers.KMSv1Prefix, []byte(name+"\x00"+endpoint))
		return "sha256:" + hex.EncodeToString(fp[:])
	}
	// oldState is the applied state of a configuration with the KMS v1 provider at
	// endpoint, as an older rekey saved it; edit changes its KMS v1 entry.
	oldState := func(t *testing.T, endpoint string, edit func(*AppliedKey)) AppliedStateStore {
		t.Helper()
		s := NewAppliedState(kmsv1Config(endpoint), nil, time.Date(2026, 1, 2, 3, 4, 5, 0, time.UTC))
		found := false
		for i := range s.Rules {
			for j := range s.Rules[i].Keys {
				if k := &s.Rules[i].Keys[j]; k.Provider == transformers.ProviderKMSv1 {
					if k.Prefix != v1Prefix || k.Endpoint != endpoint {
						t.Fatalf("kms v1 entry %+v", *k)
					}
					k.Fingerprint = spelled(k.Name, endpoint)
					if edit != nil {
						edit(k)
					}
					found = true
				}
			}
		}
		if !found {
			t.Fatal("no kms v1 entry in the applied state")
		}
		b, err := json.Marshal(s)
		if err != nil {
			t.Fatal(err)
		}
		path := filepath.Join(t.TempDir(), "applied.json")
		if err := os.WriteFile(path, b, 0o600); err != nil {
			t.Fatal(err)
		}
		return FileAppliedState{Path: path}
	}
	// Without an inventory every key the configuration cannot read counts as in use.
	start := func(state AppliedStateStore, cfg *config.Config) error {
		return CheckStartup(context.Background(), StartupOptions{State: state, Config: cfg, Logger: testLogger(t)})
	}
	for _, tc := range []struct {
		name    string
		saved   string
		edit    func(*AppliedKey)
		next    string
		refused bool
	}{
		{name: "saved unix:/, configured unix:///", saved: "unix:/tmp/x.sock", next: "unix:///tmp/x.sock"},
		{name: "saved unix:/, configured unix:/", saved: "unix:/tmp/x.sock", next: "unix:/tmp/x.sock"},
		{name: "saved unix:///, configured unix:/", saved: "unix:///tmp/x.sock", next: "unix:/tmp/x.sock"},
		{name: "saved unix:////, configured unix:///", saved: "unix:////tmp//x.sock", next: "unix:///tmp/x.sock"},
		{name: "another socket", saved: "unix:/tmp/x.sock", next: "unix:///tmp/y.sock", refused: true},
		{name: "no endpoint saved", saved: "unix:/tmp/x.sock", next: "unix:///tmp/x.sock", refused: true,
			edit: func(k *AppliedKey) { k.Endpoint = "" }},
		{name: "fingerprint of another endpoint", saved: "unix:/tmp/x.sock", next: "unix:///tmp/x.sock", refused: true,
			edit: func(k *AppliedKey) { k.Fingerprint = spelled(k.Name, "unix:/tmp/y.sock") }},
		{name: "fingerprint of another name", saved: "unix:/tmp/x.sock", next: "unix:///tmp/x.sock", refused: true,
			edit: func(k *AppliedKey) { k.Fingerprint = spelled("other", k.Endpoint) }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := start(oldState(t, tc.saved, tc.edit), kmsv1Config(tc.next))
			switch {
			case !tc.refused && err != nil:
				t.Fatalf("the same socket is refused: %v", err)
			case tc.refused && (!errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), `kms v1 provider "old"`)):
				t.Fatalf("start = %v, want a refusal naming kms v1 provider \"old\"", err)
			}
		})
	}
}
