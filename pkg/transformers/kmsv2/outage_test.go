package kmsv2

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// outageClockStart is the injected clock's time: error texts that say since when the
// plugin is unavailable show it.
var outageClockStart = time.Date(2031, 5, 6, 7, 8, 9, 0, time.UTC)

// sealedUnder returns a value sealed by a provider of its own through tp, as another
// apiserver (or this one before a restart) wrote it, the etcd key it is bound to, and
// the plugin's raw key id (which no error text may show).
func sealedUnder(t *testing.T, tp *testPlugin, name string) (stored []byte, key, rawKeyID string) {
	t.Helper()
	w := newProvider(t, name, tp.endpoint, FactoryOptions{})
	key = "/registry/secrets/ns/s"
	out, err := w.Seal(context.Background(), []byte("plaintext"), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}
	return out[len(w.Prefix()):], key, w.write.Load().keyID
}

// checkUnavailableText requires err to be a KMS-unavailable error that names provider
// and endpoint and shows no raw key id.
func checkUnavailableText(t *testing.T, what string, err error, name, endpoint, rawKeyID string) {
	t.Helper()
	if !errors.Is(err, transformers.ErrKMSUnavailable) {
		t.Fatalf("%s: %v, want an error matching ErrKMSUnavailable", what, err)
	}
	msg := err.Error()
	if !strings.Contains(msg, `"`+name+`"`) || !strings.Contains(msg, endpoint) {
		t.Errorf("%s: %q does not name provider %q and endpoint %s", what, msg, name, endpoint)
	}
	if strings.Contains(msg, rawKeyID) {
		t.Errorf("%s: %q shows the raw key id", what, msg)
	}
}

// A provider whose plugin is absent from its start: a read of a value whose DEK is not
// cached fails at once (no wait for the KMS timeout) with an error naming the
// provider, the endpoint and since when; a write is refused with a 503 that asks the
// client to come back; once the plugin listens, reads and writes work again without a
// new provider.
func TestPluginAbsentAtStart(t *testing.T) {
	tp := startPlugin(t, "key-1")
	stored, key, rawKeyID := sealedUnder(t, tp, "kms1")
	tp.Stop()

	clk := testingclock.NewFakeClock(outageClockStart)
	cfg := kmsConfig("kms1", tp.endpoint) // 3 s timeout
	p, err := New(cfg, transformers.Options{Clock: clk}, FactoryOptions{StatusInterval: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ctx := context.Background()

	for i := range 20 {
		start := time.Now()
		_, _, err := p.Open(ctx, stored, value.DefaultContext(key))
		// A read that waited for the plugin takes the whole timeout; a third of it was
		// the bound before, and a test process starved of CPU for a second (the race
		// group beside three others on two cores) met it without waiting.
		if took := time.Since(start); took >= cfg.Timeout.Duration {
			t.Fatalf("read %d with the plugin absent took %v: it waited for the plugin (timeout %v)", i, took, cfg.Timeout.Duration)
		}
		checkUnavailableText(t, "read with the plugin absent", err, "kms1", tp.endpoint, rawKeyID)
		if !strings.Contains(err.Error(), "since "+outageClockStart.Format(time.RFC3339)) {
			t.Fatalf("read with the plugin absent: %q does not say since when (the injected clock's %s)", err, outageClockStart.Format(time.RFC3339))
		}
	}
	checkUnavailableText(t, "Unavailable", p.Unavailable(), "kms1", tp.endpoint, rawKeyID)
	if st := p.Status(); !st.UnavailableSince.Equal(outageClockStart) {
		t.Errorf("status unavailableSince %v, want the injected clock's %v", st.UnavailableSince, outageClockStart)
	}
	var _ transformers.UnavailableReporter = p // what a Chain asks

	_, err = p.Seal(ctx, []byte("x"), value.DefaultContext(key))
	checkUnavailableText(t, "write with the plugin absent", err, "kms1", tp.endpoint, rawKeyID)
	var refused *transformers.WriteRefusedError
	if !errors.As(err, &refused) || refused.RetryAfter < time.Second || !apierrors.IsServiceUnavailable(err) {
		t.Fatalf("write with the plugin absent: %v, want a WriteRefusedError (503) with a Retry-After of a second or more", err)
	}
	if st := refused.Status(); st.Details == nil || st.Details.RetryAfterSeconds < 1 {
		t.Fatalf("write refusal status %+v carries no Retry-After", st)
	}

	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: tp.endpoint, KeysFile: tp.keysFile})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	// The client reconnects within a second of the plugin listening: wait on the read.
	deadline := time.Now().Add(10 * time.Second)
	for {
		out, _, err := p.Open(ctx, stored, value.DefaultContext(key))
		if err == nil {
			if string(out) != "plaintext" {
				t.Fatalf("read after the plugin came: %q", out)
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("read after the plugin came: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := p.Unavailable(); err != nil {
		t.Errorf("Unavailable after a read reached the plugin: %v", err)
	}
	if st := p.Status(); !st.UnavailableSince.IsZero() {
		t.Errorf("status unavailableSince %v after a read reached the plugin", st.UnavailableSince)
	}
	// Writes wait for the loop's next Status: step the injected clock to it.
	stepUntil(t, clk, "a write seed after the plugin came", func() bool { return p.view.Load().CanWrite })
	if _, err := p.Seal(ctx, []byte("x"), value.DefaultContext(key)); err != nil {
		t.Fatalf("write after the plugin came: %v", err)
	}
}

// stepUntil moves the injected clock a Status interval on whenever the provider's loop
// waits on it, until cond holds (within ten seconds of real time: the RPCs the loop
// makes meanwhile take real time).
func stepUntil(t *testing.T, clk *testingclock.FakeClock, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within 10s", what)
		}
		if clk.HasWaiters() {
			clk.Step(2 * time.Second)
			continue
		}
		time.Sleep(time.Millisecond) // an RPC of the loop is in flight
	}
}

// A plugin that accepts calls but does not answer them (Status ends on its deadline
// over a live connection): once a Status has found that, reads of values whose DEK is
// not cached fail without calling it, instead of each waiting for the timeout, and
// reads of cached DEKs go on. A Status that answers again lets reads call it.
func TestHungPluginReadsFailWithoutCalling(t *testing.T) {
	tp := startPlugin(t, "key-1")
	stored, key, rawKeyID := sealedUnder(t, tp, "kms1")
	clk := testingclock.NewFakeClock(outageClockStart)
	cfg := &apiserver.KMSConfiguration{APIVersion: "v2", Name: "kms1", Endpoint: tp.endpoint, Timeout: &metav1.Duration{Duration: 200 * time.Millisecond}}
	p, err := New(cfg, transformers.Options{Clock: clk}, FactoryOptions{StatusInterval: 2 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.Close)
	ctx := context.Background()
	// A first Status slower than the short timeout (a loaded machine) is retried when
	// the injected clock reaches the retry.
	stepUntil(t, clk, "a write seed", func() bool { return p.view.Load().CanWrite })
	own, err := p.Seal(ctx, []byte("own"), value.DefaultContext(key))
	if err != nil {
		t.Fatal(err)
	}

	tp.SetFaults(kmsplugin.Faults{Latency: kmsplugin.Duration{Duration: time.Minute}})
	// The loop's next Status, two injected seconds on, ends on its deadline.
	stepUntil(t, clk, "a Status finding the plugin hung", func() bool { o := p.down.Load(); return o != nil && o.hung })
	// That the read did not call the plugin is counted, not timed: the KMS timeout is
	// 200 ms here, which a starved test process takes without calling anything.
	decrypts := tp.Stats().Decrypt
	_, _, err = p.Open(ctx, stored, value.DefaultContext(key))
	checkUnavailableText(t, "read with a hung plugin", err, "kms1", tp.endpoint, rawKeyID)
	if got := tp.Stats().Decrypt; got != decrypts {
		t.Errorf("read with a hung plugin called Decrypt %d times", got-decrypts)
	}
	if out, _, err := p.Open(ctx, own[len(p.Prefix()):], value.DefaultContext(key)); err != nil || string(out) != "own" {
		t.Errorf("read under the cached write DEK with a hung plugin: %q, %v", out, err)
	}

	tp.SetFaults(kmsplugin.Faults{})
	stepUntil(t, clk, "a Status answering again", func() bool { return p.down.Load() == nil })
	// The read calls the plugin under the 200 ms timeout: one that a loaded machine
	// ends on its deadline is tried again, the injected clock stepped meanwhile to the
	// next Status.
	var out []byte
	stepUntil(t, clk, "a read after the plugin answered again", func() bool {
		out, _, err = p.Open(ctx, stored, value.DefaultContext(key))
		return err == nil
	})
	if string(out) != "plaintext" {
		t.Fatalf("read after the plugin answered again: %q", out)
	}
}
