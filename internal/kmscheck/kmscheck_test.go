package kmscheck

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// bed is a local plugin on a unix socket with keys key-a1 and key-b2 (key-a1 active).
type bed struct {
	t    *testing.T
	opts kmsplugin.Options
	srv  *kmsplugin.Server
	keys string
}

func secretOf(c byte) string { return base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{c}, 32)) }

func newBed(t *testing.T, f kmsplugin.Faults) *bed {
	t.Helper()
	dir := t.TempDir()
	b := &bed{t: t, keys: filepath.Join(dir, "keys.yaml")}
	b.writeKeys("key-a1", 'a', "key-b2", 'b')
	b.opts = kmsplugin.Options{ListenAddr: "unix://" + filepath.Join(dir, "p.sock"), KeysFile: b.keys, Faults: f}
	b.start()
	t.Cleanup(func() { b.srv.Stop() })
	return b
}

// writeKeys writes name/secret-byte pairs, the first active.
func (b *bed) writeKeys(pairs ...any) {
	var s strings.Builder
	s.WriteString("keys:\n")
	for i := 0; i < len(pairs); i += 2 {
		fmt.Fprintf(&s, "- name: %s\n  secret: %s\n", pairs[i], secretOf(byte(pairs[i+1].(rune))))
	}
	tmp := b.keys + ".tmp"
	if err := os.WriteFile(tmp, []byte(s.String()), 0o600); err != nil {
		b.t.Fatal(err)
	}
	if err := os.Rename(tmp, b.keys); err != nil {
		b.t.Fatal(err)
	}
}

func (b *bed) start() {
	s, err := kmsplugin.Start(b.opts)
	if err != nil {
		b.t.Fatal(err)
	}
	b.srv = s
}

// restart is the in-process equivalent of restarting a plugin process: a new plugin
// with the faults it starts with.
func (b *bed) restart(context.Context) error {
	b.srv.Stop()
	b.start()
	return nil
}

// options are fast: a few calls, an observation with no real waits, and at sample
// `at` the action of the test (a rotation).
func (b *bed) options(at int, action func()) Options {
	return Options{
		Endpoint: b.opts.ListenAddr,
		Calls:    5,
		Observe:  50 * time.Millisecond,
		Samples:  6,
		Timeout:  2 * time.Second,
		Sleep: func(_ context.Context, i int, _ time.Duration) error {
			if i == at && action != nil {
				action()
			}
			return nil
		},
	}
}

func run(t *testing.T, o Options) *Report {
	t.Helper()
	r, err := Run(context.Background(), o)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("%+v", r.Checks)
	return r
}

func want(t *testing.T, r *Report, verdicts map[string]Verdict) {
	t.Helper()
	for name, v := range verdicts {
		c := r.Check(name)
		if c == nil {
			t.Errorf("no check %s in the report", name)
			continue
		}
		if c.Verdict != v {
			t.Errorf("%s: %s (%s), want %s", name, c.Verdict, c.Detail, v)
		}
	}
}

// noRawKeyIDs fails when a report names a key id other than by its hash.
func noRawKeyIDs(t *testing.T, r *Report, ids ...string) {
	t.Helper()
	for _, c := range r.Checks {
		for _, id := range ids {
			if strings.Contains(c.Detail, id) {
				t.Errorf("%s names key id %q in clear: %s", c.Name, id, c.Detail)
			}
		}
	}
}

func TestHealthyPluginPasses(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{})
	r := run(t, b.options(0, nil))
	if r.Failed() {
		t.Fatalf("a healthy plugin failed: %+v", r.Checks)
	}
	want(t, r, map[string]Verdict{
		CheckReachable: Pass, CheckStatus: Pass, CheckKeyIDAgreement: Pass, CheckKeyIDStable: Pass,
		CheckRoundTrip: Pass, CheckOldKeyIDs: NotChecked, CheckKeyIDReuse: Pass, CheckAnnotations: Pass,
		CheckKeyIDLength: Pass, CheckDeadline: Pass, CheckLatencyEncrypt: Pass, CheckLatencyDecrypt: Pass,
		CheckRestartKeyID: NotChecked, CheckStartupFlap: NotChecked,
	})
	if len(r.Checks) != 14 {
		t.Errorf("%d checks, want 14", len(r.Checks))
	}
	if f := r.Check(CheckLatencyEncrypt).Figures; f["calls"] < 5 || f["p99_ms"] < f["p50_ms"] {
		t.Errorf("latency figures %v", f)
	}
	noRawKeyIDs(t, r, "key-a1")
}

func TestRotationWithOldKeysDecrypting(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{})
	r := run(t, b.options(3, func() { b.writeKeys("key-b2", 'b', "key-a1", 'a') }))
	want(t, r, map[string]Verdict{CheckKeyIDStable: Warn, CheckOldKeyIDs: Pass, CheckKeyIDReuse: Pass})
	if r.Failed() {
		t.Fatalf("a rotation failed the check: %+v", r.Checks)
	}
	noRawKeyIDs(t, r, "key-a1", "key-b2")
}

func TestStartupFlapNeedsARestart(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{StartupFlap: true})
	o := b.options(0, nil)
	o.Restart = b.restart
	r := run(t, o)
	want(t, r, map[string]Verdict{CheckStartupFlap: Fail, CheckRestartKeyID: Pass, CheckKeyIDStable: Pass})
	if !strings.Contains(r.Check(CheckStartupFlap).Detail, "restart") {
		t.Errorf("detail: %s", r.Check(CheckStartupFlap).Detail)
	}
	noRawKeyIDs(t, r, "key-a1", kmsplugin.StartupKeyURIPrefix)

	healthy := newBed(t, kmsplugin.Faults{})
	o = healthy.options(0, nil)
	o.Restart = healthy.restart
	r = run(t, o)
	want(t, r, map[string]Verdict{CheckStartupFlap: Pass, CheckRestartKeyID: Pass})
	if r.Failed() {
		t.Fatalf("a healthy plugin failed across a restart: %+v", r.Checks)
	}
}

func TestOneVersionDecrypt(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{DecryptActiveOnly: true})
	rotate := func() { b.srv.SetFaults(kmsplugin.Faults{DecryptActiveOnly: true, ActiveKey: "key-b2"}) }
	r := run(t, b.options(2, rotate))
	want(t, r, map[string]Verdict{CheckOldKeyIDs: Fail, CheckKeyIDStable: Warn, CheckRoundTrip: Pass})
	noRawKeyIDs(t, r, "key-a1", "key-b2")

	b = newBed(t, kmsplugin.Faults{DecryptActiveOnly: true})
	o := b.options(2, rotate)
	o.OneVersionPerProcess = true
	r = run(t, o)
	want(t, r, map[string]Verdict{CheckOldKeyIDs: Warn})
	if r.Failed() {
		t.Fatalf("a plugin named one version per process failed: %+v", r.Checks)
	}
}

func TestFixedKeyIDHidesRotation(t *testing.T) {
	const arn = "arn:aws:kms:eu-west-1:111122223333:key/fixed"
	b := newBed(t, kmsplugin.Faults{FixedKeyID: arn})
	r := run(t, b.options(2, func() { b.writeKeys("key-b2", 'b', "key-a1", 'a') }))
	want(t, r, map[string]Verdict{CheckKeyIDStable: Pass, CheckOldKeyIDs: NotChecked, CheckKeyIDReuse: Pass})
	if r.Failed() {
		t.Fatalf("fixed key id: %+v", r.Checks)
	}
	if !strings.Contains(r.Check(CheckOldKeyIDs).Detail, "fixed key id") {
		t.Errorf("detail does not mention a fixed key id: %s", r.Check(CheckOldKeyIDs).Detail)
	}
	noRawKeyIDs(t, r, arn)
}

func TestKeyIDReuse(t *testing.T) {
	// A → B → A with the same key: a warning.
	b := newBed(t, kmsplugin.Faults{})
	o := b.options(0, nil)
	o.Sleep = func(_ context.Context, i int, _ time.Duration) error {
		switch i {
		case 2:
			b.srv.SetFaults(kmsplugin.Faults{ActiveKey: "key-b2"})
		case 4:
			b.srv.SetFaults(kmsplugin.Faults{ActiveKey: "key-a1"})
		}
		return nil
	}
	r := run(t, o)
	want(t, r, map[string]Verdict{CheckKeyIDReuse: Warn, CheckOldKeyIDs: Pass})

	// A → B → A where the second A is other key material: a failure.
	b = newBed(t, kmsplugin.Faults{})
	o = b.options(0, nil)
	o.Sleep = func(_ context.Context, i int, _ time.Duration) error {
		switch i {
		case 2:
			b.writeKeys("key-b2", 'b')
		case 4:
			b.writeKeys("key-a1", 'z', "key-b2", 'b')
		}
		return nil
	}
	r = run(t, o)
	want(t, r, map[string]Verdict{CheckKeyIDReuse: Fail})
	noRawKeyIDs(t, r, "key-a1", "key-b2")
}

func TestLimits(t *testing.T) {
	long := strings.Repeat("k", 1025)
	b := newBed(t, kmsplugin.Faults{StatusKeyID: long, EncryptKeyID: long, Annotations: map[string]string{"NotADomain": "v"}})
	r := run(t, b.options(0, nil))
	want(t, r, map[string]Verdict{CheckKeyIDLength: Fail, CheckAnnotations: Fail})
	if f := r.Check(CheckKeyIDLength).Figures; f["max_bytes"] != 1025 || f["limit_bytes"] != 1024 {
		t.Errorf("key id length figures %v", f)
	}

	big := newBed(t, kmsplugin.Faults{Annotations: map[string]string{"size.example.com": strings.Repeat("v", 33*1024)}})
	r = run(t, big.options(0, nil))
	want(t, r, map[string]Verdict{CheckAnnotations: Fail})

	ok := newBed(t, kmsplugin.Faults{Annotations: map[string]string{"version.example.com": "7"}})
	r = run(t, ok.options(0, nil))
	want(t, r, map[string]Verdict{CheckAnnotations: Pass})
}

func TestSlowPluginMissesShortDeadline(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{})
	o := b.options(6, func() {
		b.srv.SetFaults(kmsplugin.Faults{Latency: kmsplugin.Duration{Duration: 150 * time.Millisecond}})
	})
	o.ShortDeadline = 20 * time.Millisecond
	r := run(t, o)
	want(t, r, map[string]Verdict{CheckDeadline: Warn})
	if f := r.Check(CheckDeadline).Figures; f["returned_after_ms"] > 20+60 {
		t.Errorf("the short call returned after %vms", f["returned_after_ms"])
	}
}

func TestUnhealthyAndUnreachable(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{StatusHealthz: "degraded"})
	r := run(t, b.options(0, nil))
	want(t, r, map[string]Verdict{CheckStatus: Fail, CheckRoundTrip: NotChecked})
	if !r.Failed() {
		t.Fatal("an unhealthy plugin did not fail")
	}

	r = run(t, Options{Endpoint: "unix://" + filepath.Join(t.TempDir(), "none.sock"), Timeout: time.Second})
	want(t, r, map[string]Verdict{CheckReachable: Fail, CheckStatus: NotChecked, CheckLatencyDecrypt: NotChecked})

	if _, err := Run(context.Background(), Options{Endpoint: "tcp://x"}); err == nil {
		t.Fatal("a tcp endpoint was accepted")
	}
}

func TestInterruptedRunHasNoReport(t *testing.T) {
	b := newBed(t, kmsplugin.Faults{})
	ctx, cancel := context.WithCancel(context.Background())
	o := b.options(2, cancel)
	r, err := Run(ctx, o)
	if err == nil || !strings.Contains(err.Error(), "interrupted") || r != nil {
		t.Fatalf("Run cancelled midway: report %v, err %v; want no report and an interruption error", r, err)
	}
}

func TestEndpointFromCommand(t *testing.T) {
	for cmd, want := range map[string]string{
		"kms-plugin --keys-file k --listen-addr unix:///run/p.sock": "unix:///run/p.sock",
		"kms-plugin -listen-addr=unix:///run/q.sock":                "unix:///run/q.sock",
		"kms-plugin --listen-addr='unix:///run/r.sock' --x":         "unix:///run/r.sock",
		"my-plugin --socket /run/p.sock":                            "",
	} {
		if got := EndpointFromCommand(cmd); got != want {
			t.Errorf("%s: %q, want %q", cmd, got, want)
		}
	}
}

func TestPluginCommandThatNeverListensIsStopped(t *testing.T) {
	dir := t.TempDir()
	pidFile := filepath.Join(dir, "pid")
	start := time.Now()
	_, err := StartPlugin(context.Background(), "echo $$ > "+pidFile+"; exec sleep 30", "unix://"+filepath.Join(dir, "p.sock"), 300*time.Millisecond, nil)
	if err == nil || !strings.Contains(err.Error(), "did not listen") {
		t.Fatalf("err %v, want a 'did not listen' error", err)
	}
	if time.Since(start) > 5*time.Second {
		t.Fatalf("took %s", time.Since(start))
	}
	if _, err := StartPlugin(context.Background(), "exit 3", "unix://"+filepath.Join(dir, "p.sock"), 5*time.Second, nil); err == nil || !strings.Contains(err.Error(), "exited before listening") {
		t.Fatalf("err %v, want an 'exited before listening' error", err)
	}
}
