package kmsv2

import (
	"context"
	"crypto/rand"
	"errors"
	"time"

	"github.com/google/uuid"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// run is the driver loop: it owns the state machine, the RPCs it asks for and the timer.
func (p *Provider) run(ctx context.Context, m *state.Machine) {
	defer close(p.done)
	for {
		now := p.clock.Now()
		p.coarseNow.Store(now.UnixNano())
		if ws := p.write.Load(); ws != nil {
			// Steps the count and ticks: a seed at a bound asks for its replacement now.
			_ = m.Step(state.SeedWrites{At: now, Generation: ws.spec.Generation, Writes: ws.writes.Load()})
		}
		// A Status may ask for an Encrypt: run until the machine wants nothing more now.
		p.checkFence(m)
		for acts := m.Ready(); len(acts) > 0 && ctx.Err() == nil; acts = m.Ready() {
			for _, a := range acts {
				switch a.Kind {
				case state.CallStatus:
					p.superseded(m)
					// A Status answers for the moment it was asked: stamping it when the
					// reply arrives would make an answer that straddled a change look newer
					// than it is, and Check would serve it from cache as fresh.
					askedAt := p.clock.Now()
					r, err := p.client.Status(ctx)
					p.noteStatus(askedAt, err)
					ev := state.StatusResult{At: askedAt, Err: err, Version: r.Version, Healthz: r.Healthz, KeyID: r.KeyID}
					p.recordStatus(ev)
					_ = m.Step(ev)
					p.checkFence(m)
				case state.CallEncrypt:
					_ = m.Step(p.encrypt(ctx, a))
				}
			}
		}
		if ctx.Err() != nil {
			return
		}
		// Ask the fence before the first seed is published: when it is open already (one
		// apiserver, or every plugin reports the key id) writes never see the hold.
		p.checkFence(m)
		v := m.View()
		// Before publish: a caller that waits for the view (Check) then sees the sweep done.
		p.sweepIdleDEKs(p.clock.Now())
		p.publish(v)
		wait := v.NextWake.Sub(p.clock.Now())
		if v.Held != "" || v.FirstSeedHeld {
			wait = min(wait, p.opts.FenceRecheckInterval)
		}
		if p.opts.DEKCacheIdle > 0 {
			wait = min(wait, p.nextSweep.Sub(p.clock.Now()))
		}
		if wait < 0 {
			wait = 0
		}
		t := p.clock.NewTimer(wait)
		select {
		case <-ctx.Done():
			t.Stop()
			return
		case <-t.C():
		case <-p.seedFull:
			t.Stop() // the loop's top reads the count
		case <-p.kick:
			t.Stop()
			// A request that a Status already answered (callers that asked while it ran)
			// costs no second call.
			if v := m.View(); !p.fresh(&v) {
				_ = m.Step(state.HealthCheckRequested{})
			}
		}
		m.Tick(p.clock.Now())
	}
}

// checkFence opens the cluster's write fence for a held key id once MayWriteKeyID says
// every other apiserver's plugin reports it.
func (p *Provider) checkFence(m *state.Machine) {
	if p.opts.MayWriteKeyID == nil {
		return
	}
	v := m.View()
	if v.FirstSeedHeld && v.Write != nil && p.opts.MayWriteKeyID(p.name, state.KeyIDHash(v.Write.KeyID)) {
		p.log.Info("Every apiserver's KMS plugin reports the key id of the first DEK seed; writing under it", "keyIDHash", state.KeyIDHash(v.Write.KeyID))
		_ = m.Step(state.WriteAllowed{At: p.clock.Now(), KeyID: v.Write.KeyID})
		v = m.View()
	}
	if v.Held == "" || !v.Healthy || !p.opts.MayWriteKeyID(p.name, state.KeyIDHash(v.Held)) {
		return
	}
	p.log.Info("Every apiserver's KMS plugin reports the new key id; writing under it", "keyIDHash", state.KeyIDHash(v.Held),
		"heldFor", p.clock.Since(v.HeldSince).Round(time.Millisecond))
	_ = m.Step(state.WriteAllowed{At: p.clock.Now(), KeyID: v.Held})
}

func (p *Provider) encrypt(ctx context.Context, a state.Action) state.EncryptResult {
	src := make([]byte, seedSize)
	if _, err := rand.Read(src); err != nil {
		return state.EncryptResult{At: p.clock.Now(), Seq: a.Seq, Err: err}
	}
	if a.Type != wire.SourceHKDFSeed {
		return state.EncryptResult{At: p.clock.Now(), Seq: a.Seq, Err: errUnsupportedWriteType}
	}
	uid := uuid.NewString()
	r, err := p.client.Encrypt(ctx, uid, src)
	if err != nil {
		p.log.V(2).Info("Encrypt of a new DEK seed failed", "uid", uid, "err", err)
	}
	return state.EncryptResult{At: p.clock.Now(), Seq: a.Seq, Err: err, Source: src, KeyID: r.KeyID, Ciphertext: r.Ciphertext, Annotations: r.Annotations}
}

func (p *Provider) recordStatus(ev state.StatusResult) {
	if ev.Err != nil {
		return
	}
	if code, err := wire.ValidateKeyID(ev.KeyID); err != nil {
		p.opts.Metrics.invalidKeyID.WithLabelValues(p.name, code).Inc()
		return
	}
	p.opts.Metrics.statusKeyID(p.name, state.KeyIDHash(ev.KeyID), state.KeyIDHash(p.apiID), float64(ev.At.UnixNano())/float64(time.Second))
}

var errUnsupportedWriteType = errors.New("kms v2: only HKDF_SHA256_XNONCE_AES_GCM_SEED DEK sources are written")
