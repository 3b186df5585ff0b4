package kmsv2

import (
	"fmt"
	"time"

	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// DefaultKeyIDConfirmations is FactoryOptions.KeyIDConfirmations' default: a new key id
// acts at the second healthy Status that reports it, one Status interval after the
// first, so a flap shorter than that rewrites nothing.
const DefaultKeyIDConfirmations = 2

// reportKeyID raises what the key id rules of the state machine found between the view
// prev and v (docs/kms-plugin.md, "Key ids that move"): a reuse refused, a Status/Encrypt
// disagreement, a candidate key id. It runs on the provider's loop (publish).
func (p *Provider) reportKeyID(prev, v *state.View) {
	m := p.opts.Metrics
	sink := events.OrNop(p.opts.Events)
	reused := 0.0
	if v.Reused != "" {
		reused = 1
	}
	m.keyIDReused.WithLabelValues(p.name).Set(reused)
	var prevReuses, prevDisagreements uint64
	prevCandidate, prevReused := "", ""
	if prev != nil {
		prevReuses, prevDisagreements = prev.Reuses, prev.Disagreements
		prevCandidate, prevReused = prev.Candidate, prev.Reused
	}
	if v.Reuses > prevReuses {
		m.keyIDReuses.WithLabelValues(p.name).Add(float64(v.Reuses - prevReuses))
		writing := "no DEK seed to write with: writes are refused"
		if v.Write != nil && v.CanWrite {
			writing = "writes continue under key id hash " + state.KeyIDHash(v.Write.KeyID)
		}
		msg := fmt.Sprintf("kms provider %s: the plugin reports key id hash %s again after another key id superseded it (a key id reuse, which KMS v2 forbids): it is refused as a write key and nothing migrates to it; %s; reads are unaffected. Rotate the plugin to a new key id.",
			p.name, state.KeyIDHash(v.Reused), writing)
		p.log.Error(nil, "KMS key id reuse refused", "keyIDHash", state.KeyIDHash(v.Reused), "writing", writing)
		sink.Event(events.Warning, events.ReasonKMSKeyIDReused, msg)
	} else if prevReused != "" && v.Reused == "" {
		p.log.Info("The KMS plugin no longer reports the reused key id", "keyIDHash", state.KeyIDHash(prevReused),
			"reportedKeyIDHash", state.KeyIDHash(v.Reported))
	}
	if v.Disagreements > prevDisagreements {
		m.keyIDDisagreements.WithLabelValues(p.name).Add(float64(v.Disagreements - prevDisagreements))
		p.log.Error(nil, "The KMS plugin's Encrypt answered another key id than its Status; not followed", "provider", p.name, "detail", v.Disagreement)
		sink.Event(events.Warning, events.ReasonKMSKeyIDDisagreement, fmt.Sprintf("kms provider %s: %s", p.name, v.Disagreement))
	}
	if v.Candidate != "" && v.Candidate != prevCandidate {
		p.log.Info("The KMS plugin reports a new key id; it acts once further Status answers confirm it",
			"keyIDHash", state.KeyIDHash(v.Candidate), "confirmations", p.opts.KeyIDConfirmations)
	} else if prevCandidate != "" && v.Candidate == "" && (v.Write == nil || v.Write.KeyID != prevCandidate) && v.Held != prevCandidate {
		m.keyIDFlaps.WithLabelValues(p.name).Inc()
		p.log.Info("A key id the KMS plugin reported was not confirmed; nothing was written under it", "keyIDHash", state.KeyIDHash(prevCandidate))
	}
}

// refusedReuse is Seal's error while no DEK seed can write and the plugin reports a
// refused reused key id.
func (p *Provider) refusedReuse(v *state.View) error {
	return transformers.Unavailable(&transformers.WriteRefusedError{Reason: fmt.Sprintf(
		"kms v2 provider %q refuses to write: its plugin reports key id hash %q, which another key id superseded (a key id reuse), since %s; rotate the plugin to a new key id",
		p.name, state.KeyIDHash(v.Reused), v.ReusedSince.UTC().Format(time.RFC3339))})
}

// keyIDStatus adds the key id rules' findings to st.
func keyIDStatus(st *transformers.KMSStatus, v *state.View) {
	if v.Candidate != "" {
		st.CandidateKeyIDHash, st.CandidateSince = state.KeyIDHash(v.Candidate), v.CandidateSince
	}
	if v.Reused != "" {
		st.ReusedKeyIDHash, st.ReusedSince = state.KeyIDHash(v.Reused), v.ReusedSince
	}
	st.KeyIDDisagreements, st.LastKeyIDDisagreement = v.Disagreements, v.Disagreement
}

// superseded steps the key ids FactoryOptions.SupersededKeyIDs names into m.
func (p *Provider) superseded(m *state.Machine) {
	if p.opts.SupersededKeyIDs == nil {
		return
	}
	_ = m.Step(state.Superseded{At: p.clock.Now(), KeyIDHashes: p.opts.SupersededKeyIDs(p.name)})
}
