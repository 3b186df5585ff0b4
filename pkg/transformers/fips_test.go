package transformers_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// FIPS mode is injected (Options.FIPS), never read from the process: secretbox and KMS
// v1 are refused with words naming FIPS, the provider and the resource, before any
// provider is built; the same configurations build without it; the approved providers
// build with it.
func TestFIPSRefusesProvidersOutsideTheApprovedSet(t *testing.T) {
	ctx := context.Background()
	for _, tc := range []struct {
		name, yaml string
		refused    []string
	}{
		{"secretbox", enctest.ConfigYAML("secrets", "secretbox:sb1", "aesgcm:k1"), []string{"provider secretbox \"sb1\"", "XSalsa20-Poly1305"}},
		{"secretbox-read-only", enctest.ConfigYAML("configmaps", "aesgcm:k1", "secretbox:old"), []string{"resources configmaps: provider secretbox \"old\""}},
		{"kmsv1", enctest.ConfigYAML("secrets", "aesgcm:k1") + "      - kms: {name: legacy, endpoint: unix:///tmp/legacy.sock}\n", []string{"provider kmsv1 \"legacy\"", "KMS v1"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cfg := enctest.MustConfig(t, tc.yaml)
			_, err := transformers.Build(ctx, cfg, transformers.Options{FIPS: transformers.FIPSOn})
			if !errors.Is(err, transformers.ErrNotFIPSApproved) {
				t.Fatalf("FIPS mode: err = %v, want ErrNotFIPSApproved", err)
			}
			for _, want := range append(tc.refused, "FIPS 140-3", "rekey rotate --provider aesgcm") {
				if !strings.Contains(err.Error(), want) {
					t.Errorf("error lacks %q: %v", want, err)
				}
			}
			if strings.Contains(err.Error(), "aesgcm \"k1\"") {
				t.Errorf("an approved provider is named as refused: %v", err)
			}
			if err := transformers.FIPSRefusal(cfg, transformers.FIPSOn); err == nil {
				t.Fatal("FIPSRefusal accepts what Build refuses")
			}
			if tc.name == "kmsv1" {
				return // building a KMS v1 reader dials its plugin
			}
			set, err := transformers.Build(ctx, cfg, transformers.Options{})
			if err != nil {
				t.Fatalf("without FIPS mode: %v", err)
			}
			set.Close()
		})
	}
	approved := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:k1", "aescbc:k2", "identity"))
	set, err := transformers.Build(ctx, approved, transformers.Options{FIPS: transformers.FIPSOn})
	if err != nil {
		t.Fatalf("aesgcm, aescbc and identity in FIPS mode: %v", err)
	}
	set.Close()
	// KMS v2 is approved in both modes (under fips140=only it seals with random nonces).
	kms := enctest.MustConfig(t, enctest.ConfigYAML("secrets")+"      - kms: {apiVersion: v2, name: vault, endpoint: unix:///tmp/vault.sock}\n")
	for _, mode := range []transformers.FIPSMode{transformers.FIPSOn, transformers.FIPSOnly} {
		if err := transformers.FIPSRefusal(kms, mode); err != nil {
			t.Fatalf("KMS v2 with fips140=%s: %v", mode, err)
		}
	}
	if err := transformers.FIPSRefusal(enctest.MustConfig(t, enctest.ConfigYAML("secrets", "secretbox:sb1")), transformers.FIPSOff); err != nil {
		t.Fatalf("FIPS off refuses: %v", err)
	}
	if got := transformers.FIPSModeOf(true, true); got != transformers.FIPSOnly {
		t.Errorf("FIPSModeOf(enabled, enforced) = %s", got)
	}
	if got := transformers.FIPSModeOf(true, false); got != transformers.FIPSOn {
		t.Errorf("FIPSModeOf(enabled) = %s", got)
	}
	for _, p := range []string{transformers.ProviderAESGCM, transformers.ProviderAESCBC, transformers.ProviderKMSv2, transformers.ProviderIdentity} {
		if ok, why := transformers.FIPSApproved(p); !ok {
			t.Errorf("%s refused: %s", p, why)
		}
	}
}

// StoredPrefix is SplitPrefix's inverse for every provider that stores values.
func TestStoredPrefixInvertsSplitPrefix(t *testing.T) {
	for _, p := range []string{transformers.ProviderAESGCM, transformers.ProviderAESCBC, transformers.ProviderSecretbox, transformers.ProviderKMSv2, transformers.ProviderKMSv1} {
		prefix := transformers.KeyInfo{Provider: p, Key: "k1"}.StoredPrefix()
		if gotP, gotK := transformers.SplitPrefix(prefix); gotP != p || gotK != "k1" {
			t.Errorf("%s: StoredPrefix %q splits into %s/%s", p, prefix, gotP, gotK)
		}
	}
	if got := (transformers.KeyInfo{Provider: transformers.ProviderIdentity}).StoredPrefix(); got != "" {
		t.Errorf("identity: %q", got)
	}
}
