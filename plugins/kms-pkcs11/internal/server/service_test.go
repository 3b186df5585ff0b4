package server_test

import (
	"bytes"
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/go-logr/logr"
	"github.com/prometheus/client_golang/prometheus"
	"google.golang.org/grpc"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	kmsapi "k8s.io/kms/apis/v2"
	"k8s.io/kms/pkg/service"
	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/server"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/softhsmtest"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/token"
)

var (
	secrets = schema.GroupResource{Resource: "secrets"}
	aad     = value.DefaultContext("/registry/secrets/ns/name")
)

func tokenConfig(h *softhsmtest.Token, pin string) token.Config {
	return token.Config{Module: h.Module, TokenLabel: h.Label, PIN: pin, KeyLabel: "kek", MaxSessions: softhsmtest.MaxSessions, SessionWait: 2 * time.Second}
}

// admin opens the token as the CLI does, beside the plugin.
func admin(t *testing.T, h *softhsmtest.Token) *token.Token { return adminB(t, h) }

func adminB(t testing.TB, h *softhsmtest.Token) *token.Token {
	t.Helper()
	tok, err := token.Open(tokenConfig(h, h.PIN))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(tok.Close)
	return tok
}

type plugin struct {
	svc      *server.Service
	endpoint string
	dir      string
	logins   *atomic.Int64
	pin      *atomic.Value // the PIN the next login attempt uses
	reg      *prometheus.Registry
	clock    *clocktesting.FakeClock
}

// startPlugin serves the token over a unix socket in a private directory; its loop is
// driven by the test's fake clock (Step).
func startPlugin(t *testing.T, h *softhsmtest.Token, pin string) *plugin {
	return startPluginWith(t, h, pin)
}

func startPluginB(b *testing.B, h *softhsmtest.Token) *plugin { return startPluginWith(b, h, h.PIN) }

func startPluginWith(t testing.TB, h *softhsmtest.Token, pin string) *plugin {
	t.Helper()
	dir, err := os.MkdirTemp("", "kp")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = os.RemoveAll(dir) })
	p := &plugin{dir: dir, logins: &atomic.Int64{}, pin: &atomic.Value{}, reg: prometheus.NewRegistry(), clock: clocktesting.NewFakeClock(time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC))}
	p.pin.Store(pin)
	p.svc, err = server.New(server.Options{
		Open: func() (*token.Token, error) {
			p.logins.Add(1)
			return token.Open(tokenConfig(h, p.pin.Load().(string)))
		},
		KeyLabel:           "kek",
		LoginRetryInterval: time.Minute,
		ProbeInterval:      30 * time.Second,
		RefreshInterval:    10 * time.Second,
		Clock:              p.clock,
		Logger:             logr.Discard(),
		Registry:           p.reg,
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(p.svc.Close)
	p.svc.Step(p.clock.Now())
	addr, err := kmsplugin.CheckListenAddr("unix://" + filepath.Join(dir, "kms.sock"))
	if err != nil {
		t.Fatal(err)
	}
	lis, err := kmsplugin.ListenUnix(addr)
	if err != nil {
		t.Fatal(err)
	}
	gs := grpc.NewServer()
	kmsapi.RegisterKeyManagementServiceServer(gs, service.NewGRPCService(addr, 0, p.svc))
	go func() { _ = gs.Serve(lis) }()
	t.Cleanup(gs.Stop)
	p.endpoint = "unix://" + addr
	return p
}

// decrypts is how many Decrypt calls the plugin answered so far.
func (p *plugin) decrypts(t testing.TB) float64 {
	t.Helper()
	mfs, err := p.reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var n float64
	for _, mf := range mfs {
		if mf.GetName() != "rekey_kms_pkcs11_requests_total" {
			continue
		}
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "method" && l.GetValue() == "Decrypt" {
					n += m.GetCounter().GetValue()
				}
			}
		}
	}
	return n
}

// advance moves the fake clock and steps the plugin's loop.
func (p *plugin) advance(d time.Duration) {
	p.clock.Step(d)
	p.svc.Step(p.clock.Now())
}

func writeConfig(t testing.TB, dir, file, name, endpoint string) string {
	t.Helper()
	path := filepath.Join(dir, file+".yaml")
	cfg := fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: ["secrets"]
  providers:
  - kms:
      apiVersion: v2
      name: %s
      endpoint: %s
      timeout: 5s
`, name, endpoint)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}

// upstream is kube-apiserver's own KMS v2 transformer (k8s.io/apiserver).
func upstream(t *testing.T, p *plugin, name string) value.Transformer { return upstreamB(t, p, name) }

func upstreamB(t testing.TB, p *plugin, name string) value.Transformer {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	t.Cleanup(cancel)
	ec, err := encryptionconfig.LoadEncryptionConfig(ctx, writeConfig(t, p.dir, name+"-up", name, p.endpoint), true, "id")
	if err != nil {
		t.Fatal(err)
	}
	tr := ec.Transformers[secrets]
	deadline := time.Now().Add(15 * time.Second)
	for {
		if _, err := tr.TransformToStorage(ctx, []byte("probe"), aad); err == nil {
			return tr
		} else if time.Now().After(deadline) {
			t.Fatalf("upstream's transformer never became ready: %v", err)
		}
		time.Sleep(20 * time.Millisecond) // waiting on upstream's own priming goroutine
	}
}

// ours is rekey's transformers (pkg/transformers with its KMS v2 provider).
func ours(t *testing.T, p *plugin, name string) (value.Transformer, *kmsv2.Provider) {
	return oursB(t, p, name)
}

func oursB(t testing.TB, p *plugin, name string) (value.Transformer, *kmsv2.Provider) {
	t.Helper()
	cfg, err := config.Load(writeConfig(t, p.dir, name+"-ours", name, p.endpoint), config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	cfg.Encryption.Resources[0].Providers[0].KMS.Name = name
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: metrics.NewKubeRegistry(), HealthyTTL: time.Nanosecond})})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for _, k := range set.KMSProviders() {
		if err := k.WaitReady(ctx); err != nil {
			t.Fatal(err)
		}
	}
	return set.TransformerFor(secrets), set.KMSProviders()[0].(*kmsv2.Provider)
}

func read(t *testing.T, what string, r value.Transformer, stored []byte, want string) {
	t.Helper()
	got, _, err := r.TransformFromStorage(context.Background(), stored, aad)
	if err != nil || string(got) != want {
		t.Fatalf("%s: read %q, %v; want %q", what, got, err, want)
	}
}

func write(t *testing.T, w value.Transformer, pt string) []byte {
	t.Helper()
	stored, err := w.TransformToStorage(context.Background(), []byte(pt), aad)
	if err != nil {
		t.Fatal(err)
	}
	return stored
}

// TestWireCompatibility: values written through upstream's KMS v2 transformer read
// through rekey's and the other way round, before and after a rotation of the token.
func TestWireCompatibility(t *testing.T) {
	h := softhsmtest.New(t)
	adm := admin(t, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	p := startPlugin(t, h, h.PIN)
	up := upstream(t, p, "hsm")
	our, ourProvider := ours(t, p, "hsm")
	v1up, v1ours := write(t, up, "upstream-v1"), write(t, our, "rekey-v1")
	read(t, "rekey reads upstream's value", our, v1up, "upstream-v1")
	read(t, "upstream reads rekey's value", up, v1ours, "rekey-v1")

	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	// Upstream picks a new key id up on a fresh load; rekey's provider once its Status
	// checks confirmed it.
	up2 := upstream(t, p, "hsm")
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	for range kmsv2.DefaultKeyIDConfirmations + 1 {
		if err := ourProvider.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if got := ourProvider.WriteKeyIDHash(); got != hashOf("kek:v2") {
		t.Fatalf("rekey's provider writes under %s after the rotation, want kek:v2's %s", got, hashOf("kek:v2"))
	}
	v2up, v2ours := write(t, up2, "upstream-v2"), write(t, our, "rekey-v2")
	for _, c := range []struct {
		what string
		r    value.Transformer
		v    []byte
		want string
	}{
		{"rekey reads upstream's v1 value", our, v1up, "upstream-v1"},
		{"rekey reads upstream's v2 value", our, v2up, "upstream-v2"},
		{"upstream reads rekey's v1 value", up2, v1ours, "rekey-v1"},
		{"upstream reads rekey's v2 value", up2, v2ours, "rekey-v2"},
		{"the first upstream reads rekey's v2 value", up, v2ours, "rekey-v2"},
	} {
		read(t, c.what, c.r, c.v, c.want)
	}
}

func hashOf(keyID string) string {
	return kmsv2HashForTest(keyID)
}

// TestRotationsKeepEveryVersionReadable: three rotations; a reader in the same
// process decrypts what every version sealed; a retired version stops decrypting
// within the refresh interval; numbers are never reused.
func TestRotationsKeepEveryVersionReadable(t *testing.T) {
	h := softhsmtest.New(t)
	adm := admin(t, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	p := startPlugin(t, h, h.PIN)
	ctx := context.Background()
	type sealed struct {
		keyID string
		ct    []byte
		pt    []byte
	}
	var all []sealed
	for i := 1; i <= 4; i++ {
		st, err := p.svc.Status(ctx)
		if err != nil || st.Healthz != "ok" || st.KeyID != fmt.Sprintf("kek:v%d", i) {
			t.Fatalf("Status after %d rotations: %+v, %v", i-1, st, err)
		}
		for j := 0; j < 3; j++ {
			pt := []byte(fmt.Sprintf("dek-seed-%d-%d", i, j))
			r, err := p.svc.Encrypt(ctx, "uid", pt)
			if err != nil {
				t.Fatal(err)
			}
			if r.KeyID != st.KeyID {
				t.Fatalf("Encrypt sealed with %s while Status reports %s", r.KeyID, st.KeyID)
			}
			all = append(all, sealed{r.KeyID, r.Ciphertext, pt})
		}
		for _, s := range all {
			got, err := p.svc.Decrypt(ctx, "uid", &service.DecryptRequest{Ciphertext: s.ct, KeyID: s.keyID})
			if err != nil || !bytes.Equal(got, s.pt) {
				t.Fatalf("after %d rotations, %s no longer decrypts: %v", i-1, s.keyID, err)
			}
		}
		if _, err := adm.Rotate(time.Now()); err != nil {
			t.Fatal(err)
		}
	}
	// A ciphertext presented under another version's key id fails (the key id is
	// authenticated).
	if _, err := p.svc.Decrypt(ctx, "uid", &service.DecryptRequest{Ciphertext: all[0].ct, KeyID: "kek:v2"}); err == nil {
		t.Fatal("a v1 ciphertext opened as kek:v2")
	}
	if err := adm.Retire(1, time.Now()); err != nil {
		t.Fatal(err)
	}
	p.advance(10 * time.Second)
	if _, err := p.svc.Decrypt(ctx, "uid", &service.DecryptRequest{Ciphertext: all[0].ct, KeyID: all[0].keyID}); err == nil || !strings.Contains(err.Error(), "retired") {
		t.Fatalf("a retired version still decrypts: %v", err)
	}
	if err := adm.Destroy(1); err != nil {
		t.Fatal(err)
	}
	v, err := adm.Rotate(time.Now())
	if err != nil || v.Number != 6 {
		t.Fatalf("the rotation after destroying version 1 issued %+v, %v; want 6", v, err)
	}
	// The plugin's sessions are bounded: many concurrent calls finish within the
	// session wait with the pool of softhsmtest.MaxSessions (a leaked session would
	// starve them).
	errs := make(chan error, 64)
	for range 64 {
		go func() {
			_, err := p.svc.Decrypt(ctx, "uid", &service.DecryptRequest{Ciphertext: all[5].ct, KeyID: all[5].keyID})
			errs <- err
		}()
	}
	for range 64 {
		if err := <-errs; err != nil {
			t.Fatal(err)
		}
	}
	if n := p.svc.AdminSessionsInUse(); n != 0 {
		t.Fatalf("%d state sessions still open after every call returned", n)
	}
}

// TestWrongPINOneLoginPerInterval: with a wrong PIN the plugin attempts one login per
// --login-retry-interval however often it is called, and Status names the cause
// without the PIN; with the PIN file fixed it recovers at the next attempt.
func TestWrongPINOneLoginPerInterval(t *testing.T) {
	h := softhsmtest.New(t)
	// PKCS#11 logins are the process's: the admin handle logs out (closes) before the
	// plugin starts, or the plugin would share its login.
	adm, err := token.Open(tokenConfig(h, h.PIN))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	adm.Close()
	const wrong = "not-the-pin-31337"
	p := startPlugin(t, h, wrong)
	ctx := context.Background()
	conn, err := grpc.NewClient(p.endpoint, grpc.WithTransportCredentials(insecureCreds()), grpc.WithContextDialer(func(ctx context.Context, a string) (net.Conn, error) {
		return (&net.Dialer{}).DialContext(ctx, "unix", strings.TrimPrefix(a, "unix://"))
	}))
	if err != nil {
		t.Fatal(err)
	}
	defer conn.Close()
	cli := kmsapi.NewKeyManagementServiceClient(conn)
	for sec := 0; sec < 150; sec++ {
		for range 5 {
			st, err := cli.Status(ctx, &kmsapi.StatusRequest{})
			if err != nil {
				t.Fatal(err)
			}
			if st.Healthz == "ok" || !strings.Contains(st.Healthz, "CKR_PIN_INCORRECT") || strings.Contains(st.Healthz, wrong) {
				t.Fatalf("Status with a wrong PIN: %q", st.Healthz)
			}
			if _, err := cli.Encrypt(ctx, &kmsapi.EncryptRequest{Plaintext: []byte("x"), Uid: "u"}); err == nil || strings.Contains(err.Error(), wrong) {
				t.Fatalf("Encrypt with a wrong PIN: %v", err)
			}
		}
		p.advance(time.Second)
	}
	// 150 s at one attempt per minute: at 0 s, 60 s and 120 s.
	if n := p.logins.Load(); n != 3 {
		t.Fatalf("%d login attempts in 150 s of calls, want 3 (one per minute)", n)
	}
	st, _ := p.svc.Status(ctx)
	t.Logf("unhealthy Status: %s", st.Healthz)

	// The PIN corrected (the binary reads its --pin-file at every attempt): the next
	// attempt, not an earlier one, logs in.
	p.pin.Store(h.PIN)
	p.advance(29 * time.Second) // 179 s: the next attempt is due at 180 s
	if st, _ := p.svc.Status(ctx); st.Healthz == "ok" || p.logins.Load() != 3 {
		t.Fatalf("logged in before the interval passed: %q after %d attempts", st.Healthz, p.logins.Load())
	}
	p.advance(time.Second)
	if st, _ := p.svc.Status(ctx); st.Healthz != "ok" || st.KeyID != "kek:v1" || p.logins.Load() != 4 {
		t.Fatalf("after the PIN was corrected: %+v after %d attempts", st, p.logins.Load())
	}
}

// TestProbeReportsALostKey: the current version's key object deleted behind the
// plugin's back (by OpenSC's pkcs11-tool, another process): the next probe fails and
// Status reports unhealthy with the cause, until a rotation gives a working version.
func TestProbeReportsALostKey(t *testing.T) {
	h := softhsmtest.New(t)
	adm, err := token.Open(tokenConfig(h, h.PIN))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	adm.Close()
	p := startPlugin(t, h, h.PIN)
	ctx := context.Background()
	if st, _ := p.svc.Status(ctx); st.Healthz != "ok" {
		t.Fatalf("Status before: %q", st.Healthz)
	}
	tool, err := exec.LookPath("pkcs11-tool")
	if err != nil {
		t.Fatalf("OpenSC's pkcs11-tool is not installed; install it with: %s", softhsmtest.InstallCommand)
	}
	// CKA_ID "1" is 0x31.
	out, err := exec.Command(tool, "--module", h.Module, "--token-label", h.Label, "--login", "--pin", h.PIN,
		"--delete-object", "--type", "secrkey", "--id", "31", "--label", "kek").CombinedOutput()
	if err != nil {
		t.Fatalf("pkcs11-tool --delete-object: %v\n%s", err, out)
	}
	p.advance(29 * time.Second)
	if st, _ := p.svc.Status(ctx); st.Healthz != "ok" {
		t.Fatalf("Status changed before the next probe was due (the probe result is cached): %q", st.Healthz)
	}
	p.advance(time.Second)
	st, _ := p.svc.Status(ctx)
	if st.Healthz == "ok" || !strings.Contains(st.Healthz, "health probe") || !strings.Contains(st.Healthz, "no key object of that version") || strings.Contains(st.Healthz, h.PIN) {
		t.Fatalf("Status after the key was lost: %q", st.Healthz)
	}
	t.Logf("unhealthy Status: %s", st.Healthz)
}
