package transformers

import (
	"errors"
	"fmt"
	"strings"

	"github.com/rekey-io/rekey/pkg/config"
)

// ErrNotFIPSApproved is wrapped by the error of a configuration that FIPS mode refuses
// (FIPSRefusal).
var ErrNotFIPSApproved = errors.New("not approved in FIPS 140-3 mode")

// FIPSMode is the FIPS 140-3 mode a process runs in: the binary reads it at its edge
// (FIPSModeOf(crypto/fips140.Enabled(), crypto/fips140.Enforced())) and passes it in.
type FIPSMode int

const (
	// FIPSOff: not in FIPS mode; every provider is accepted.
	FIPSOff FIPSMode = iota
	// FIPSOn: GODEBUG=fips140=on; providers outside the approved set are refused.
	FIPSOn
	// FIPSOnly: GODEBUG=fips140=only, where Go itself refuses non-approved uses at run
	// time; KMS v2 seals with random nonces there (kmsv2.FactoryOptions.RandomNonces).
	FIPSOnly
)

// FIPSModeOf is the mode of crypto/fips140's two answers.
func FIPSModeOf(enabled, enforced bool) FIPSMode {
	switch {
	case enforced:
		return FIPSOnly
	case enabled:
		return FIPSOn
	}
	return FIPSOff
}

func (m FIPSMode) String() string {
	switch m {
	case FIPSOn:
		return "on"
	case FIPSOnly:
		return "only"
	}
	return "off"
}

// FIPSApprovedIn is FIPSApproved in a mode (FIPSOff approves every provider). KMS v2
// is approved under FIPSOnly too: its provider then seals with random nonces
// (kmsv2.FactoryOptions.RandomNonces), the AES-GCM Go's enforcement allows.
func FIPSApprovedIn(mode FIPSMode, provider string) (ok bool, why string) {
	if mode == FIPSOff {
		return true, ""
	}
	return FIPSApproved(provider)
}

// FIPSApproved reports whether a provider (Provider*) may be configured in FIPS 140-3
// mode, and if not, why. The approved set:
//
//   - aesgcm: AES-GCM (SP 800-38D), and kms (v2): AES-GCM under DEKs the plugin wraps,
//     derived from a seed with HKDF-SHA-256 (SP 800-56C);
//   - aescbc: AES-CBC (SP 800-38A), an approved mode (unauthenticated: prefer aesgcm);
//   - identity: no cryptography (plaintext; a rule that reads old plaintext values).
//
// Refused: secretbox (XSalsa20-Poly1305 is not a FIPS algorithm) and kmsv1 (KMS v1's
// envelope is deprecated, and values of clusters before 1.25 are AES-CBC under DEKs a
// plugin of unknown conformance wrapped; migrate off it before turning FIPS mode on).
func FIPSApproved(provider string) (ok bool, why string) {
	switch provider {
	case ProviderIdentity, ProviderAESGCM, ProviderAESCBC, ProviderKMSv2:
		return true, ""
	case ProviderSecretbox:
		return false, "XSalsa20-Poly1305 is not a FIPS 140-3 approved algorithm"
	case ProviderKMSv1:
		return false, "the KMS v1 envelope is deprecated and not supported in FIPS mode"
	}
	return false, "it is not a provider rekey knows"
}

// FIPSRefusal returns nil when mode is FIPSOff or every provider of cfg is approved in
// that mode (FIPSApprovedIn), and otherwise one error naming FIPS and every provider refused, by
// resource and name, with what to do. It is the one check of the rule: Build applies it
// when Options.FIPS is set (start-up, reload, every rekey command that builds a
// configuration), and rekey check-config calls it before anything else.
func FIPSRefusal(cfg *config.Config, mode FIPSMode) error {
	if mode == FIPSOff {
		return nil
	}
	var refused []string
	seen := map[string]bool{}
	for _, e := range Describe(cfg) {
		for _, k := range e.Items {
			ok, why := FIPSApprovedIn(mode, k.Provider)
			if ok {
				continue
			}
			what := k.Provider
			if k.Name != "" {
				what += " " + fmt.Sprintf("%q", k.Name)
			}
			line := fmt.Sprintf("resources %s: provider %s (%s)", strings.Join(e.Resources, ","), what, why)
			if !seen[line] {
				seen[line] = true
				refused = append(refused, line)
			}
		}
	}
	if len(refused) == 0 {
		return nil
	}
	approved := "aesgcm, aescbc, kms v2, identity"
	if mode == FIPSOnly {
		approved = "aesgcm, aescbc, identity"
	}
	return fmt.Errorf("%w: FIPS 140-3 mode (%s) refuses the configuration: it names providers outside the approved set (%s):\n  %s\n"+
		"rotate those resources to aesgcm or KMS v2 (rekey rotate --provider aesgcm), migrate, and remove the provider before running in FIPS mode",
		ErrNotFIPSApproved, mode, approved, strings.Join(refused, "\n  "))
}
