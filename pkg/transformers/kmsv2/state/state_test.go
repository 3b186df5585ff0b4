package state

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestTranscripts runs testdata/*.txt: each file is a story told as commands (what the
// plugin answers, how much time passes) and the machine's answers (the RPCs it asked for
// and what it then allows). `go test -run TestTranscripts -rewrite` rewrites the answers;
// read the diff before committing it.
//
// Commands:
//
//	reset [fenced [first-seed-hold=<d>]] [seed-max-age=<d>] [seed-max-writes=N] [confirm=N]
//	                                       a new machine at +0s; the plugin is healthy with key id 1;
//	                                       fenced: Config.Fenced, and the view gains a fence line;
//	                                       a seed bound: the view gains a seed line;
//	                                       confirm: Config.KeyIDConfirmations
//	superseded key=K...                    Steps Superseded naming these key ids (the ledger's)
//	writes n=N [gen=G]                     Steps SeedWrites: the current write state (or generation
//	                                       G) encrypted N values
//	allow key=K                            Steps WriteAllowed for K (the cluster's write fence opened)
//	status [healthz=ok] [version=v2] [key=1] [key-len=N] [err=msg]
//	                                       what the plugin's Status answers from now on
//	encrypt [key=1] [key-len=N] [ciphertext=wrapped] [ciphertext-len=N] [annotation=k] [annotation-len=N] [source-len=32] [err=msg]
//	                                       what the plugin's Encrypt answers from now on
//	advance <duration> [times=N]           moves the clock (N times), each time running every
//	                                       RPC the machine asks for as the driver does; prints
//	                                       the RPCs and then the view
//	request-health                         Steps HealthCheckRequested
//	ready                                  prints Ready's actions without running them
//	step-status / step-encrypt seq=N       Steps the plugin's current answer (at the current
//	                                       time) for an RPC that `ready` handed out
//	view                                   prints the view
func TestTranscripts(t *testing.T) {
	datadriven.Walk(t, "testdata", func(t *testing.T, path string) {
		h := newHarness()
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			return h.run(t, d)
		})
	})
}

// harness drives a Machine the way the provider's loop does, with a scripted plugin.
type harness struct {
	m       *Machine
	now     time.Time
	status  StatusResult
	encrypt EncryptResult
	fenced  bool
	seed    bool
}

func newHarness() *harness {
	return &harness{
		now:     t0,
		m:       New(Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed}, t0),
		status:  StatusResult{Version: "v2", Healthz: "ok", KeyID: "1"},
		encrypt: EncryptResult{KeyID: "1", Ciphertext: []byte("wrapped"), Source: make([]byte, 32)},
	}
}

func (h *harness) run(t *testing.T, d *datadriven.TestData) string {
	switch d.Cmd {
	case "reset":
		*h = *newHarness()
		cfg := Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed}
		if d.HasArg("fenced") {
			h.fenced = true
			cfg.Fenced = true
			cfg.FirstSeedHold = durationArg(t, d, "first-seed-hold")
		}
		if cfg.SeedMaxAge = durationArg(t, d, "seed-max-age"); cfg.SeedMaxAge > 0 {
			h.seed = true
		}
		if d.MaybeScanArgs(t, "seed-max-writes", &cfg.SeedMaxWrites) {
			h.seed = true
		}
		d.MaybeScanArgs(t, "confirm", &cfg.KeyIDConfirmations)
		h.m = New(cfg, t0)
		return h.view()
	case "writes":
		ev := SeedWrites{At: h.now}
		d.ScanArgs(t, "n", &ev.Writes)
		if w := h.m.View().Write; w != nil {
			ev.Generation = w.Generation
		}
		d.MaybeScanArgs(t, "gen", &ev.Generation)
		if err := h.m.Step(ev); err != nil {
			d.Fatalf(t, "%v", err)
		}
		var b strings.Builder
		h.advance(&b, 0)
		return b.String() + h.view()
	case "allow":
		if err := h.m.Step(WriteAllowed{At: h.now, KeyID: keyArg(t, d)}); err != nil {
			d.Fatalf(t, "%v", err)
		}
		return h.view()
	case "superseded":
		ev := Superseded{At: h.now}
		for _, a := range d.CmdArgs {
			for _, k := range a.Vals {
				ev.KeyIDHashes = append(ev.KeyIDHashes, KeyIDHash(k))
			}
		}
		if err := h.m.Step(ev); err != nil {
			d.Fatalf(t, "%v", err)
		}
		return h.view()
	case "status":
		h.status = StatusResult{Version: "v2", Healthz: "ok", KeyID: keyArg(t, d)}
		d.MaybeScanArgs(t, "healthz", &h.status.Healthz)
		d.MaybeScanArgs(t, "version", &h.status.Version)
		h.status.Err = errArg(t, d)
		return "ok"
	case "encrypt":
		h.encrypt = EncryptResult{KeyID: keyArg(t, d), Ciphertext: []byte("wrapped"), Err: errArg(t, d)}
		var s string
		if d.MaybeScanArgs(t, "ciphertext", &s) {
			h.encrypt.Ciphertext = []byte(s)
		}
		n := -1
		if d.MaybeScanArgs(t, "ciphertext-len", &n) {
			h.encrypt.Ciphertext = make([]byte, n)
		}
		if d.MaybeScanArgs(t, "annotation", &s) {
			n = 0
			d.MaybeScanArgs(t, "annotation-len", &n)
			h.encrypt.Annotations = map[string][]byte{s: make([]byte, n)}
		}
		n = 32
		d.MaybeScanArgs(t, "source-len", &n)
		h.encrypt.Source = make([]byte, n)
		return "ok"
	case "advance":
		if len(d.CmdArgs) == 0 {
			d.Fatalf(t, "advance needs a duration")
		}
		step, err := time.ParseDuration(d.CmdArgs[0].Key)
		if err != nil {
			d.Fatalf(t, "%v", err)
		}
		times := 1
		d.MaybeScanArgs(t, "times", &times)
		var b strings.Builder
		for range times {
			h.advance(&b, step)
		}
		return b.String() + h.view()
	case "request-health":
		if err := h.m.Step(HealthCheckRequested{}); err != nil {
			d.Fatalf(t, "%v", err)
		}
		return h.view()
	case "ready":
		var b strings.Builder
		for _, a := range h.m.Ready() {
			fmt.Fprintf(&b, "%s\n", action(a))
		}
		return b.String() + "."
	case "step-status":
		r := h.status
		r.At = h.now
		if err := h.m.Step(r); err != nil {
			d.Fatalf(t, "%v", err)
		}
		return h.view()
	case "step-encrypt":
		r := h.encrypt
		r.At = h.now
		d.ScanArgs(t, "seq", &r.Seq)
		if err := h.m.Step(r); err != nil {
			d.Fatalf(t, "%v", err)
		}
		return h.view()
	case "view":
		return h.view()
	}
	d.Fatalf(t, "unknown command %q", d.Cmd)
	return ""
}

// durationArg is the duration argument key, zero when absent.
func durationArg(t *testing.T, d *datadriven.TestData, key string) time.Duration {
	var s string
	if !d.MaybeScanArgs(t, key, &s) {
		return 0
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		d.Fatalf(t, "%s: %v", key, err)
	}
	return v
}

func keyArg(t *testing.T, d *datadriven.TestData) string {
	key := "1"
	d.MaybeScanArgs(t, "key", &key)
	n := 0
	if d.MaybeScanArgs(t, "key-len", &n) {
		key = strings.Repeat("k", n)
	}
	return key
}

func errArg(t *testing.T, d *datadriven.TestData) error {
	var msg string
	if d.MaybeScanArgs(t, "err", &msg) {
		return fmt.Errorf("%s", msg)
	}
	return nil
}

// advance moves time and runs every RPC the machine asks for, as the driver does,
// writing one line per RPC.
func (h *harness) advance(b *strings.Builder, d time.Duration) {
	h.now = h.now.Add(d)
	h.m.Tick(h.now)
	for acts := h.m.Ready(); len(acts) > 0; acts = h.m.Ready() {
		for _, a := range acts {
			fmt.Fprintf(b, "%s: %s\n", rel(h.now), action(a))
			switch a.Kind {
			case CallStatus:
				r := h.status
				r.At = h.now
				_ = h.m.Step(r)
			case CallEncrypt:
				r := h.encrypt
				r.At, r.Seq = h.now, a.Seq
				_ = h.m.Step(r)
			}
		}
	}
}

func action(a Action) string {
	if a.Kind == CallEncrypt {
		return fmt.Sprintf("Encrypt seq=%d type=%s", a.Seq, a.Type)
	}
	return a.Kind.String()
}

// rel prints a time as its offset from the start of the story.
func rel(at time.Time) string {
	if at.IsZero() {
		return "never"
	}
	return "+" + at.Sub(t0).String()
}

// view prints the View in three lines: the time and what is allowed; the write state;
// the error, if any.
func (h *harness) view() string {
	v := h.m.View()
	var b strings.Builder
	fmt.Fprintf(&b, "%s: can-write=%t healthy=%t rotating=%t next-status=%s last-healthy=%s\n",
		rel(v.Now), v.CanWrite, v.Healthy, v.Rotating, rel(v.NextWake), rel(v.LastHealthy))
	if w := v.Write; w != nil {
		fmt.Fprintf(&b, "write: gen=%d key=%s type=%s ciphertext=%q expiry=%s", w.Generation, w.KeyID, w.Type, w.Ciphertext, rel(w.Expiry))
	} else {
		b.WriteString("write: none")
	}
	if h.fenced {
		fmt.Fprintf(&b, "\nfence: reported=%s held=%s since=%s", orNone(v.Reported), orNone(v.Held), rel(v.HeldSince))
		if v.FirstSeedHeld {
			fmt.Fprintf(&b, " first-seed-held-until=%s", rel(v.FirstSeedHeldUntil))
		}
		if v.FirstSeedHoldExpired {
			b.WriteString(" first-seed-hold-expired")
		}
	}
	if h.seed && v.Write != nil {
		fmt.Fprintf(&b, "\nseed: created=%s writes=%d refresh=%s due=%s", rel(v.Write.Created), v.SeedWrites, orNone(v.Write.Refresh), orNone(v.RefreshDue))
	}
	if v.Candidate != "" || v.Reused != "" || v.Reuses > 0 || v.Disagreements > 0 {
		fmt.Fprintf(&b, "\nkey-id: candidate=%s seen=%d since=%s reused=%s since=%s reuses=%d disagreements=%d",
			orNone(v.Candidate), v.CandidateSeen, rel(v.CandidateSince), orNone(v.Reused), rel(v.ReusedSince), v.Reuses, v.Disagreements)
		if v.Disagreement != "" {
			fmt.Fprintf(&b, "\ndisagreement: %s", v.Disagreement)
		}
	}
	if v.Err != nil {
		fmt.Fprintf(&b, "\nerr: %v", v.Err)
	}
	return b.String()
}

func orNone(s string) string {
	if s == "" {
		return "none"
	}
	return s
}

// Ready's slice is the caller's: a later Ready must not change it.
func TestReadyResultIsOwnedByTheCaller(t *testing.T) {
	m := New(Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed}, t0)
	first := m.Ready()
	if len(first) != 1 || first[0].Kind != CallStatus {
		t.Fatalf("first Ready: %v, want one Status", first)
	}
	if err := m.Step(StatusResult{At: t0, Version: "v2", Healthz: "ok", KeyID: "1"}); err != nil {
		t.Fatal(err)
	}
	if second := m.Ready(); len(second) != 1 || second[0].Kind != CallEncrypt {
		t.Fatalf("second Ready: %v, want one Encrypt", second)
	}
	if first[0].Kind != CallStatus {
		t.Fatalf("the second Ready changed the first one's slice: %v", first)
	}
}

func TestNilEventIsRejected(t *testing.T) {
	m := New(Config{Provider: "kms1"}, t0)
	if err := m.Step(nil); err == nil {
		t.Fatal("a nil event was accepted")
	}
}

// Errors and the disagreement carry key ids only as hashes.
func TestErrorsCarryKeyIDHashesOnly(t *testing.T) {
	h := newHarness()
	var b strings.Builder
	h.status.KeyID, h.encrypt.KeyID = "secret-key-5", "secret-key-6"
	h.advance(&b, 0)
	err := h.m.View().Err
	if err == nil || !strings.Contains(err.Error(), KeyIDHash("secret-key-5")) || strings.Contains(err.Error(), "secret-key") {
		t.Fatalf("error must name key ids by hash only: %v", err)
	}
	h.status.KeyID, h.encrypt.KeyID = "secret-key-5", "secret-key-5"
	h.advance(&b, time.Minute)
	h.status.KeyID, h.encrypt.KeyID = "secret-key-7", "secret-key-8"
	h.advance(&b, time.Minute)
	v := h.m.View()
	if d := v.Disagreement; v.Disagreements != 2 || !strings.Contains(d, KeyIDHash("secret-key-8")) || strings.Contains(d, "secret-key") {
		t.Fatalf("disagreement must name key ids by hash only: %d %q", v.Disagreements, d)
	}
}

// An unreachable plugin is asked again no later than a healthy one would be: a Status
// interval below the retry interval's default bounds the retries too.
func TestRetryIntervalNeverExceedsStatusInterval(t *testing.T) {
	m := New(Config{Provider: "kms1", WriteType: wire.SourceHKDFSeed, StatusInterval: 2 * time.Second}, t0)
	m.Ready()
	if err := m.Step(StatusResult{At: t0, Err: fmt.Errorf("connection refused")}); err != nil {
		t.Fatal(err)
	}
	if got := m.View().NextWake.Sub(t0); got != 2*time.Second {
		t.Fatalf("next Status after a failure in %s, want 2s", got)
	}
}

// An unreachable plugin is asked again every RetryInterval, which by default is never
// longer than the Status interval: a plugin that returns is served again within one
// Status interval, whatever that is set to.
func TestRetryIntervalDefaultsToTheStatusIntervalWhenShorter(t *testing.T) {
	for _, tc := range []struct{ status, want time.Duration }{
		{2 * time.Second, 2 * time.Second},
		{time.Minute, DefaultRetryInterval},
		{DefaultRetryInterval, DefaultRetryInterval},
	} {
		m := New(Config{Provider: "kms", WriteType: wire.SourceHKDFSeed, StatusInterval: tc.status}, t0)
		if acts := m.Ready(); len(acts) != 1 || acts[0].Kind != CallStatus {
			t.Fatalf("status interval %v: first actions %v, want one Status", tc.status, acts)
		}
		_ = m.Step(StatusResult{At: t0, Err: fmt.Errorf("connection refused")})
		if got := m.View().NextWake.Sub(t0); got != tc.want {
			t.Errorf("status interval %v: next Status %v after a failed one, want %v", tc.status, got, tc.want)
		}
	}
}
