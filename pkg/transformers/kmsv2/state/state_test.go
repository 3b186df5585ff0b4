package state

import (
	"errors"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// harness drives a Machine the way the provider's loop does, with a scripted plugin.
type harness struct {
	t        *testing.T
	m        *Machine
	now      time.Time
	encrypts int
	statuses int
	// plugin answers
	status  StatusResult
	encrypt EncryptResult
}

func newHarness(t *testing.T) *harness {
	h := &harness{t: t, now: t0, m: New(Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed}, t0)}
	h.status = StatusResult{Version: "v2", Healthz: "ok", KeyID: "1"}
	h.encrypt = EncryptResult{KeyID: "1", Ciphertext: []byte("wrapped"), Source: make([]byte, 32)}
	return h
}

// advance moves time and runs every RPC the machine asks for, as the driver does.
func (h *harness) advance(d time.Duration) View {
	h.now = h.now.Add(d)
	h.m.Tick(h.now)
	for acts := h.m.Ready(); len(acts) > 0; acts = h.m.Ready() {
		for _, a := range append([]Action(nil), acts...) {
			switch a.Kind {
			case CallStatus:
				h.statuses++
				r := h.status
				r.At = h.now
				if err := h.m.Step(r); err != nil {
					h.t.Fatal(err)
				}
			case CallEncrypt:
				h.encrypts++
				r := h.encrypt
				r.At, r.Seq = h.now, a.Seq
				if a.Type != h.m.cfg.WriteType {
					h.t.Fatalf("Encrypt asked for type %v, machine writes %v", a.Type, h.m.cfg.WriteType)
				}
				if err := h.m.Step(r); err != nil {
					h.t.Fatal(err)
				}
			}
		}
	}
	return h.m.View()
}

func (h *harness) expect(v View, canWrite, healthy bool, keyID string, expiry time.Time, statuses, encrypts int, errSub string) {
	h.t.Helper()
	if v.CanWrite != canWrite || v.Healthy != healthy {
		h.t.Errorf("at +%v: CanWrite=%v Healthy=%v, want %v %v (err %v)", h.now.Sub(t0), v.CanWrite, v.Healthy, canWrite, healthy, v.Err)
	}
	gotKey := ""
	var gotExp time.Time
	if v.Write != nil {
		gotKey, gotExp = v.Write.KeyID, v.Write.Expiry
	}
	if gotKey != keyID || !gotExp.Equal(expiry) {
		h.t.Errorf("at +%v: write key %q expiry +%v, want %q +%v", h.now.Sub(t0), gotKey, gotExp.Sub(t0), keyID, expiry.Sub(t0))
	}
	if h.statuses != statuses || h.encrypts != encrypts {
		h.t.Errorf("at +%v: %d Status / %d Encrypt calls, want %d / %d", h.now.Sub(t0), h.statuses, h.encrypts, statuses, encrypts)
	}
	switch {
	case errSub == "" && v.Err != nil:
		h.t.Errorf("at +%v: unexpected error %v", h.now.Sub(t0), v.Err)
	case errSub != "" && (v.Err == nil || !strings.Contains(v.Err.Error(), errSub)):
		h.t.Errorf("at +%v: error %v, want one containing %q", h.now.Sub(t0), v.Err, errSub)
	}
}

func at(d time.Duration) time.Time { return t0.Add(d) }

func TestHappyPathNoPreviousState(t *testing.T) {
	h := newHarness(t)
	v := h.advance(0)
	h.expect(v, true, true, "1", at(3*time.Minute), 1, 1, "")
	if v.Write.Generation != 1 || string(v.Write.Ciphertext) != "wrapped" || v.Write.Type != wire.SourceHKDFSeed {
		t.Errorf("write state %+v", v.Write)
	}
	if !v.NextWake.Equal(at(time.Minute)) {
		t.Errorf("next Status at +%v, want +1m", v.NextWake.Sub(t0))
	}
	// Nothing happens before the next Status is due.
	v = h.advance(59 * time.Second)
	h.expect(v, true, true, "1", at(3*time.Minute), 1, 1, "")
}

func TestSameKeyIDExtendsWithoutEncrypt(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.encrypt.Err = errors.New("broken") // must not be called
	v := h.advance(time.Minute)
	h.expect(v, true, true, "1", at(4*time.Minute), 2, 1, "")
	if v.Write.Generation != 1 {
		t.Errorf("generation %d, want the same seed (1)", v.Write.Generation)
	}
}

func TestExpiredStateWithMatchingKeyIDIsRevivedWithoutEncrypt(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.status.Err = errors.New("plugin down")
	for i := 0; i < 30; i++ { // 5 minutes of failing Status every 10 s
		h.advance(10 * time.Second)
	}
	v := h.m.View()
	h.expect(v, false, false, "1", at(3*time.Minute), 26, 1, "plugin down")
	h.status.Err = nil
	h.encrypt.Err = errors.New("broken") // not called: key id matches
	v = h.advance(10 * time.Second)
	h.expect(v, true, true, "1", at(5*time.Minute+10*time.Second+3*time.Minute), 27, 1, "")
}

func TestExpiredStateWithOtherKeyIDRotates(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.advance(time.Hour) // one Status at +1h keeps it alive; make it expire instead:
	h.status.Err = errors.New("down")
	h.advance(time.Minute)
	h.advance(5 * time.Minute)
	h.status = StatusResult{Version: "v2", Healthz: "ok", KeyID: "4"}
	h.encrypt.KeyID = "4"
	v := h.advance(10 * time.Second)
	want := h.now.Add(3 * time.Minute)
	h.expect(v, true, true, "4", want, 5, 2, "")
	if v.Write.Generation != 2 {
		t.Errorf("generation %d, want 2", v.Write.Generation)
	}
}

func TestEncryptFailureKeepsOldStateAndExpiry(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.status.KeyID = "5"
	h.encrypt.Err = errors.New("broken")
	v := h.advance(time.Minute)
	h.expect(v, true, false, "1", at(3*time.Minute), 2, 2, "failed to encrypt DEK, error: broken")
	if !strings.Contains(v.Err.Error(), KeyIDHash("5")) || strings.Contains(v.Err.Error(), `"5"`) {
		t.Errorf("error must carry key ids only as hashes: %v", v.Err)
	}
	// Retries every 10 s; each retry is a Status then an Encrypt; writes stop at +3m.
	v = h.advance(10 * time.Second)
	h.expect(v, true, false, "1", at(3*time.Minute), 3, 3, "broken")
	for h.now.Before(at(3 * time.Minute)) {
		v = h.advance(10 * time.Second)
	}
	h.expect(v, false, false, "1", at(3*time.Minute), 14, 14, "broken")
	h.encrypt = EncryptResult{KeyID: "5", Ciphertext: []byte("w5"), Source: make([]byte, 32)}
	v = h.advance(10 * time.Second)
	h.expect(v, true, true, "5", h.now.Add(3*time.Minute), 15, 15, "")
}

func TestInvalidEncryptResponses(t *testing.T) {
	long := strings.Repeat("k", 1025)
	for _, tc := range []struct {
		name    string
		enc     EncryptResult
		errSub  string
		withOld bool
	}{
		{"annotation key not a domain, no previous state", EncryptResult{KeyID: "1", Ciphertext: []byte("c"), Annotations: map[string][]byte{"panda": nil}}, "at least two segments", false},
		{"annotation key not a domain, previous state kept", EncryptResult{KeyID: "3", Ciphertext: []byte("c"), Annotations: map[string][]byte{"panda": nil}}, "at least two segments", true},
		{"Encrypt key id differs from Status key id", EncryptResult{KeyID: "other", Ciphertext: []byte("c")}, "differs from the Status key id", false},
		{"empty ciphertext", EncryptResult{KeyID: "1"}, "encrypted DEK source is empty", false},
		{"ciphertext too long", EncryptResult{KeyID: "1", Ciphertext: make([]byte, 1025)}, "exceeds the max size of 1024", false},
		{"annotations too large", EncryptResult{KeyID: "1", Ciphertext: []byte("c"), Annotations: map[string][]byte{"a.b": make([]byte, 32*1024)}}, "total size of annotations", false},
		{"key id too long", EncryptResult{KeyID: long, Ciphertext: []byte("c")}, "differs", false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			wantKey, wantExp, enc := "", time.Time{}, 1
			if tc.withOld {
				h.advance(0)
				wantKey, wantExp, enc = "1", at(3*time.Minute), 2
				h.status.KeyID = "3"
			}
			tc.enc.Source = make([]byte, 32)
			h.encrypt = tc.enc
			v := h.advance(0)
			if tc.withOld {
				v = h.advance(time.Minute)
			}
			statuses := 1
			if tc.withOld {
				statuses = 2
			}
			h.expect(v, tc.withOld, false, wantKey, wantExp, statuses, enc, tc.errSub)
		})
	}
}

// kubernetes/kubernetes#138950: an unhealthy Status must not extend the write window.
func TestUnhealthyStatusNeverExtendsWrites(t *testing.T) {
	for _, tc := range []struct {
		name   string
		status StatusResult
		errSub string
	}{
		{"healthz not ok", StatusResult{Version: "v2", Healthz: "degraded", KeyID: "1"}, "got unexpected healthz status: degraded"},
		{"bad version", StatusResult{Version: "v1", Healthz: "ok", KeyID: "1"}, "expected KMSv2 API version v2, got v1"},
		{"version changes", StatusResult{Version: "v2beta1", Healthz: "ok", KeyID: "1"}, "should not change after the initial status response version v2"},
		{"empty key id", StatusResult{Version: "v2", Healthz: "ok", KeyID: ""}, "keyID is empty"},
		{"key id too long", StatusResult{Version: "v2", Healthz: "ok", KeyID: strings.Repeat("x", 1025)}, "exceeds the max size of 1024"},
		{"new key id but unhealthy", StatusResult{Version: "v2", Healthz: "bad", KeyID: "2"}, "unexpected healthz"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			h := newHarness(t)
			h.advance(0)
			h.status = tc.status
			v := h.advance(time.Minute)
			h.expect(v, true, false, "1", at(3*time.Minute), 2, 1, tc.errSub)
			if !v.NextWake.Equal(at(time.Minute + 10*time.Second)) {
				t.Errorf("unhealthy: next Status at +%v, want +1m10s", v.NextWake.Sub(t0))
			}
			for h.now.Before(at(3*time.Minute + 30*time.Second)) {
				v = h.advance(10 * time.Second)
			}
			if v.CanWrite || !v.Write.Expiry.Equal(at(3*time.Minute)) {
				t.Errorf("writes still allowed (expiry +%v) 3m after the last healthy Status", v.Write.Expiry.Sub(t0))
			}
			if h.encrypts != 1 {
				t.Errorf("an unhealthy Status rotated the seed (%d Encrypt calls)", h.encrypts)
			}
		})
	}
}

func TestSourceTypeChangeRotates(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	if err := h.m.Step(WriteTypeChanged{Type: wire.SourceAESGCMKey}); err != nil {
		t.Fatal(err)
	}
	v := h.advance(time.Minute)
	h.expect(v, true, true, "1", at(4*time.Minute), 2, 2, "")
	if v.Write.Type != wire.SourceAESGCMKey || v.Write.Generation != 2 {
		t.Errorf("write state %+v, want AES_GCM_KEY generation 2", v.Write)
	}
}

func TestHealthCheckRequestMakesStatusDueNow(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.advance(5 * time.Second)
	if h.statuses != 1 {
		t.Fatalf("%d Status calls before due", h.statuses)
	}
	_ = h.m.Step(HealthCheckRequested{})
	v := h.advance(0)
	h.expect(v, true, true, "1", at(5*time.Second+3*time.Minute), 2, 1, "")
	if err := h.m.Step(42); err == nil {
		t.Error("unknown event accepted")
	}
}

func TestStaleEncryptResultIgnored(t *testing.T) {
	h := newHarness(t)
	h.m.Tick(t0)
	acts := h.m.Ready()
	if len(acts) != 1 || acts[0].Kind != CallStatus {
		t.Fatalf("first actions %v", acts)
	}
	_ = h.m.Step(StatusResult{At: t0, Version: "v2", Healthz: "ok", KeyID: "1"})
	acts = h.m.Ready()
	if len(acts) != 1 || acts[0].Kind != CallEncrypt {
		t.Fatalf("after a first healthy Status: %v, want one Encrypt", acts)
	}
	_ = h.m.Step(EncryptResult{At: t0, Seq: acts[0].Seq + 7, KeyID: "1", Ciphertext: []byte("x"), Source: make([]byte, 32)})
	if h.m.View().Write != nil {
		t.Fatal("a result for another request was accepted")
	}
	if got := h.m.Ready(); len(got) != 0 {
		t.Fatalf("actions while an Encrypt is in flight: %v", got)
	}
}

// Outage story (field-faults K2-K4): plugin down under 3 min keeps writes; past 3 min
// writes stop, reads are not the machine's business; recovery re-enables writes with the
// same seed.
func TestOutageGraceAndRecovery(t *testing.T) {
	h := newHarness(t)
	h.advance(0)
	h.advance(time.Minute) // healthy: expiry +4m
	h.status.Err = errors.New("connection refused")
	v := h.advance(time.Minute) // +2m fails
	h.expect(v, true, false, "1", at(4*time.Minute), 3, 1, "connection refused")
	for h.now.Before(at(4*time.Minute + 20*time.Second)) {
		v = h.advance(10 * time.Second)
	}
	h.expect(v, false, false, "1", at(4*time.Minute), 17, 1, "failed to perform status section")
	h.status.Err = nil
	v = h.advance(10 * time.Second)
	h.expect(v, true, true, "1", h.now.Add(3*time.Minute), 18, 1, "")
}
