package kmsv2

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// recordedEvents is an events.Sink for tests.
type recordedEvents struct {
	mu      sync.Mutex
	reasons []string
	msgs    []string
}

func (r *recordedEvents) Event(_ events.Kind, reason, message string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	r.reasons = append(r.reasons, reason)
	r.msgs = append(r.msgs, message)
}

func (r *recordedEvents) of(reason string) []string {
	r.mu.Lock()
	defer r.mu.Unlock()
	var out []string
	for i, x := range r.reasons {
		if x == reason {
			out = append(out, r.msgs[i])
		}
	}
	return out
}

// statuses asks the provider for n fresh Statuses (HealthyTTL is a nanosecond).
func statuses(t *testing.T, p *Provider, n int) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for range n {
		if err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
}

// counter is the value of the counter name in reg (0 when it has no series).
func counter(t *testing.T, reg metrics.KubeRegistry, name string) float64 {
	t.Helper()
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	sum := 0.0
	for _, mf := range mfs {
		if mf.GetName() == name {
			for _, m := range mf.GetMetric() {
				sum += m.GetCounter().GetValue()
			}
		}
	}
	return sum
}

// A → B → A: the plugin returns to a key id this provider rotated away from. Refused
// as a write key (writes continue under B), raised as an Event, a metric and in Status;
// everything written before stays readable. Back at B, the reuse clears.
func TestKeyIDReuseIsRefusedAndRaised(t *testing.T) {
	tp := startPlugin(t, "key-a", "key-b")
	reg := metrics.NewKubeRegistry()
	ev := &recordedEvents{}
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{Registry: reg, HealthyTTL: time.Nanosecond, Events: ev})
	underA := sealOpen(t, p, []byte("under-a"))

	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-b"})
	statuses(t, p, DefaultKeyIDConfirmations)
	if st := p.Status(); st.KeyIDHash != state.KeyIDHash("key-b") {
		t.Fatalf("after the rotation to key-b: writing under %s", st.KeyIDHash)
	}
	underB := sealOpen(t, p, []byte("under-b"))

	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-a"})
	statuses(t, p, 3)
	st := p.Status()
	if st.KeyIDHash != state.KeyIDHash("key-b") || st.ReusedKeyIDHash != state.KeyIDHash("key-a") || !st.Healthy {
		t.Fatalf("after key-a came back: %+v; want writes under key-b, key-a reported as reused, healthy", st)
	}
	if got := counter(t, reg, "rekey_kmsv2_key_id_reuses_total"); got != 1 {
		t.Fatalf("rekey_kmsv2_key_id_reuses_total = %v, want 1", got)
	}
	if msgs := ev.of(events.ReasonKMSKeyIDReused); len(msgs) != 1 || !strings.Contains(msgs[0], state.KeyIDHash("key-a")) || strings.Contains(msgs[0], "key-a ") {
		t.Fatalf("reuse events: %q", msgs)
	}
	// Reads of both keys' values and writes go on.
	for _, v := range [][]byte{underA, underB, sealOpen(t, p, []byte("during"))} {
		if _, _, err := p.Open(context.Background(), v[len(p.Prefix()):], aad); err != nil {
			t.Fatal(err)
		}
	}
	if st := p.Status(); st.KeyIDHash != state.KeyIDHash("key-b") {
		t.Fatalf("a write during the reuse went under %s", st.KeyIDHash)
	}

	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-b"})
	statuses(t, p, 1)
	if st := p.Status(); st.ReusedKeyIDHash != "" {
		t.Fatalf("the reuse did not clear once the plugin reported key-b again: %+v", st)
	}
}

// A key id reported by one Status only (and by Encrypt meanwhile) is a flap: no new
// DEK seed, counted as a flap, the provider stays healthy.
func TestKeyIDFlapShorterThanConfirmationsWritesNothingUnderIt(t *testing.T) {
	tp := startPlugin(t, "key-a", "key-f")
	reg := metrics.NewKubeRegistry()
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{Registry: reg, HealthyTTL: time.Nanosecond})
	gen := p.write.Load().spec.Generation

	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-f"})
	statuses(t, p, DefaultKeyIDConfirmations-1)
	if st := p.Status(); st.CandidateKeyIDHash != state.KeyIDHash("key-f") || !st.Healthy {
		t.Fatalf("during the flap: %+v", st)
	}
	sealOpen(t, p, []byte("during the flap"))
	tp.SetFaults(kmsplugin.Faults{})
	statuses(t, p, 1)
	if g := p.write.Load().spec.Generation; g != gen {
		t.Fatalf("the flap made a new DEK seed (generation %d → %d)", gen, g)
	}
	if got := counter(t, reg, "rekey_kmsv2_key_id_flaps_total"); got != 1 {
		t.Fatalf("rekey_kmsv2_key_id_flaps_total = %v, want 1", got)
	}
}

// Status and Encrypt disagreeing (Status moves, Encrypt does not) is reported and not
// followed: the provider keeps its seed, stays healthy, and counts it.
func TestStatusEncryptDisagreementIsReportedNotFollowed(t *testing.T) {
	tp := startPlugin(t, "key-a")
	reg := metrics.NewKubeRegistry()
	ev := &recordedEvents{}
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{Registry: reg, HealthyTTL: time.Nanosecond, Events: ev})
	gen := p.write.Load().spec.Generation
	tp.SetFaults(kmsplugin.Faults{StatusKeyID: "key-s"})
	statuses(t, p, DefaultKeyIDConfirmations)
	st := p.Status()
	if !st.Healthy || st.KeyIDHash != state.KeyIDHash("key-a") || st.KeyIDDisagreements != 1 || p.write.Load().spec.Generation != gen {
		t.Fatalf("after the disagreement: %+v", st)
	}
	if got := counter(t, reg, "rekey_kmsv2_key_id_disagreements_total"); got != 1 {
		t.Fatalf("rekey_kmsv2_key_id_disagreements_total = %v, want 1", got)
	}
	if msgs := ev.of(events.ReasonKMSKeyIDDisagreement); len(msgs) != 1 {
		t.Fatalf("disagreement events: %q", msgs)
	}
	sealOpen(t, p, []byte("still writes"))
}

// A provider that starts while its plugin reports a key id the ledger shows superseded
// (SupersededKeyIDs) takes no DEK seed: writes are refused with a 503 that names the
// reuse, the provider stays healthy, and values stored under every key id still read.
func TestStartAtASupersededKeyIDRefusesWritesOnly(t *testing.T) {
	tp := startPlugin(t, "key-a", "key-b")
	writer := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	underA := sealOpen(t, writer, []byte("under-a"))
	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-b"})
	writerB := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	underB := sealOpen(t, writerB, []byte("under-b"))
	tp.SetFaults(kmsplugin.Faults{ActiveKey: "key-a"})

	reg := metrics.NewKubeRegistry()
	p, err := New(kmsConfig("kms1", tp.endpoint), transformers.Options{APIServerID: "test"}, FactoryOptions{Registry: reg, HealthyTTL: time.Nanosecond,
		SupersededKeyIDs: func(provider string) []string {
			if provider != "kms1" {
				return nil
			}
			return []string{state.KeyIDHash("key-a")}
		}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	for p.Status().ReusedKeyIDHash == "" {
		if err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
		if ctx.Err() != nil {
			t.Fatal("the reuse was never reported")
		}
	}
	if st := p.Status(); !st.Healthy || st.KeyIDHash != "" || st.ReusedKeyIDHash != state.KeyIDHash("key-a") {
		t.Fatalf("status %+v; want healthy, no write key id, key-a reused", st)
	}
	_, err = p.Seal(ctx, []byte("x"), aad)
	var refused *transformers.WriteRefusedError
	if !errors.As(err, &refused) || !errors.Is(err, transformers.ErrKMSUnavailable) || !strings.Contains(err.Error(), state.KeyIDHash("key-a")) {
		t.Fatalf("Seal during the reuse: %v; want a WriteRefusedError naming the reused key id hash", err)
	}
	for _, v := range [][]byte{underA, underB} {
		if _, _, err := p.Open(ctx, v[len(p.Prefix()):], aad); err != nil {
			t.Fatalf("a stored value does not read during the reuse: %v", err)
		}
	}
	if got := counter(t, reg, "rekey_kmsv2_key_id_reuses_total"); got != 1 {
		t.Fatalf("rekey_kmsv2_key_id_reuses_total = %v, want 1", got)
	}
}
