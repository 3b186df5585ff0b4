package reload

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/go-logr/logr/funcr"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/internal/leakcheck"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// quiet drops every log line (a zero logr.Logger would mean "use klog").
var quiet = funcr.New(func(string, string) {}, funcr.Options{})

// realPlugin is the in-process kms-plugin serving on a unix socket in a short temp dir
// (socket paths are limited to 107 bytes).
type realPlugin struct {
	*kmsplugin.Server
	endpoint string
}

func startRealPlugin(tb testing.TB, dir, name string) *realPlugin {
	tb.Helper()
	keys := filepath.Join(dir, name+"-keys.yaml")
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	if err := os.WriteFile(keys, []byte("keys:\n- name: "+name+"-kek\n  secret: "+base64.StdEncoding.EncodeToString(secret)+"\n"), 0o600); err != nil {
		tb.Fatal(err)
	}
	p := &realPlugin{endpoint: "unix://" + filepath.Join(dir, name+".sock")}
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: p.endpoint, KeysFile: keys})
	if err != nil {
		tb.Fatal(err)
	}
	p.Server = s
	tb.Cleanup(s.Stop)
	return p
}

func shortTempDir(tb testing.TB) string {
	tb.Helper()
	dir, err := os.MkdirTemp("", "rl")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	return dir
}

// kmsEntry renders a kms v2 provider on endpoint.
func kmsEntry(name, endpoint string) string {
	return fmt.Sprintf("  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: %s\n      timeout: 1s\n", name, endpoint)
}

func kmsSecretsConfig(entries ...string) string {
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n" +
		strings.Join(entries, "") + provider("aesgcm:k1")
}

// With the real KMS v2 provider and plugin on unix sockets: a reload to a new plugin is
// applied and old data stays readable; a reload to a plugin that is not listening is
// refused until it is, then applied by a retry; afterwards no gRPC connection or
// goroutine of any replaced provider is left.
func TestKMSv2RealPluginReloads(t *testing.T) {
	dir := shortTempDir(t)
	a := startRealPlugin(t, dir, "a")
	path := filepath.Join(dir, "enc.yaml")
	writeRename(t, path, kmsSecretsConfig(kmsEntry("a", a.endpoint)))
	reg := metrics.NewKubeRegistry()
	opts := Options{
		Path:              path,
		AutomaticReload:   true,
		PollInterval:      time.Hour,
		GracePeriod:       100 * time.Millisecond,
		HealthGateTimeout: 2 * time.Second, // a plugin's first answer on a loaded machine
		Transformers:      transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: reg})},
		Registry:          reg,
		Logger:            quiet,
	}
	agent, err := NewAgent(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	runDone := make(chan struct{})
	go func() {
		defer close(runDone)
		agent.Run(ctx)
	}()
	tr := agent.TransformerForResource(secrets)
	write := func(k string) []byte {
		t.Helper()
		var out []byte
		eventually(t, "a write to succeed", func() bool {
			var err error
			out, err = tr.TransformToStorage(context.Background(), []byte("v:"+k), value.DefaultContext(k))
			return err == nil
		})
		return out
	}
	old := write("/registry/secrets/ns/a")
	if !bytes.HasPrefix(old, []byte("k8s:enc:kms:v2:a:")) {
		t.Fatalf("prefix %q", old[:20])
	}
	if err := agent.HealthChecker().Check(nil); err != nil {
		t.Fatalf("health: %v", err)
	}

	// A new plugin in front.
	b := startRealPlugin(t, dir, "b")
	next := kmsSecretsConfig(kmsEntry("b", b.endpoint), kmsEntry("a", a.endpoint))
	writeRename(t, path, next)
	eventually(t, "plugin b to write", func() bool {
		out, err := tr.TransformToStorage(context.Background(), []byte("x"), value.DefaultContext("/registry/secrets/ns/x"))
		return err == nil && bytes.HasPrefix(out, []byte("k8s:enc:kms:v2:b:"))
	})
	if got, stale, err := tr.TransformFromStorage(context.Background(), old, value.DefaultContext("/registry/secrets/ns/a")); err != nil || !stale || string(got) != "v:/registry/secrets/ns/a" {
		t.Fatalf("old value: %q stale=%v %v", got, stale, err)
	}

	// A new plugin that fails the health gate, with a real plugin: c is not listening yet.
	cEndpoint := "unix://" + filepath.Join(dir, "c.sock")
	third := kmsSecretsConfig(kmsEntry("c", cEndpoint), kmsEntry("b", b.endpoint), kmsEntry("a", a.endpoint))
	// Counted from here: under load, b's own health gate can have failed once before
	// its retry applied it, and that refusal is not c's.
	failedBefore := agent.Status().ReloadsFailed
	writeRename(t, path, third)
	eventually(t, "the refusal", func() bool { return agent.Status().ReloadsFailed > failedBefore })
	if st := agent.Status(); st.Resources[0].KMS == nil || st.Resources[0].KMS.Name != "b" {
		t.Fatalf("serving config changed: %+v", st.Resources[0])
	}
	if !strings.Contains(agent.Status().LastError, `kms provider "c"`) {
		t.Fatalf("last error: %s", agent.Status().LastError)
	}
	c := startRealPlugin(t, dir, "c")
	eventually(t, "the retry to apply plugin c", func() bool {
		out, err := tr.TransformToStorage(context.Background(), []byte("x"), value.DefaultContext("/registry/secrets/ns/x"))
		return err == nil && bytes.HasPrefix(out, []byte("k8s:enc:kms:v2:c:"))
	})
	st := agent.Status()
	if !st.Resources[0].KMS.Healthy || !strings.HasPrefix(st.Resources[0].KMS.KeyIDHash, "sha256:") || st.Resources[0].KMS.WriteExpiry.IsZero() {
		t.Fatalf("kms status: %+v", st.Resources[0].KMS)
	}
	eventually(t, "replaced providers to close", func() bool { return agent.Status().ReplacedPendingClose == 0 })
	cancel()
	<-runDone
	agent.Close()
	// With the plugins gone too, nothing of any provider may be left.
	for _, p := range []*realPlugin{a, b, c} {
		p.Stop()
	}
	leakcheck.Verify(t)
}

// BenchmarkReloadLatency measures, per iteration, the time from the rename of a new
// configuration into place to the first write that uses it, with the default debounce
// and a writer polling every 100 µs. It reports p50 and p99 next to upstream's poll
// interval (1 min; 30 s on average). Run:
//
//	go test -run '^$' -bench ReloadLatency -benchtime 300x ./pkg/reload/
func BenchmarkReloadLatency(b *testing.B) {
	b.Run("local", func(b *testing.B) {
		benchReloadLatency(b, func(b *testing.B, dir string, i int) (string, string) {
			key := fmt.Sprintf("aesgcm:k%d", i%2)
			return fmt.Sprintf("# %d\n", i) + secretsConfig(key, "aesgcm:k0,k1"), fmt.Sprintf("k8s:enc:aesgcm:v1:k%d:", i%2)
		})
	})
	b.Run("kmsv2-new-plugin", func(b *testing.B) {
		benchReloadLatency(b, func(b *testing.B, dir string, i int) (string, string) {
			name := fmt.Sprintf("p%d", i)
			p := startRealPlugin(b, dir, name)
			return kmsSecretsConfig(kmsEntry(name, p.endpoint)), "k8s:enc:kms:v2:" + name + ":"
		})
	})
}

// benchReloadLatency: next prepares (untimed) iteration i's config and the prefix its
// writes carry.
func benchReloadLatency(b *testing.B, next func(b *testing.B, dir string, i int) (content, prefix string)) {
	dir := shortTempDir(b)
	path := filepath.Join(dir, "enc.yaml")
	first, _ := next(b, dir, 0)
	writeRename(b, path, first)
	agent, err := NewAgent(context.Background(), Options{
		Path:            path,
		AutomaticReload: true,
		GracePeriod:     time.Second,
		Transformers:    transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{})},
		Logger:          quiet,
	})
	if err != nil {
		b.Fatal(err)
	}
	defer agent.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		agent.Run(ctx)
	}()
	defer func() { cancel(); <-done }()
	tr := agent.TransformerForResource(secrets)
	dataCtx := value.DefaultContext("/registry/secrets/ns/bench")

	samples := make([]time.Duration, 0, b.N)
	b.ResetTimer()
	for i := 1; i <= b.N; i++ {
		b.StopTimer()
		content, prefix := next(b, dir, i)
		tmp := path + ".tmp"
		if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
			b.Fatal(err)
		}
		b.StartTimer()
		start := time.Now()
		if err := os.Rename(tmp, path); err != nil {
			b.Fatal(err)
		}
		for {
			out, err := tr.TransformToStorage(context.Background(), []byte("x"), dataCtx)
			if err == nil && bytes.HasPrefix(out, []byte(prefix)) {
				break
			}
			if time.Since(start) > 30*time.Second {
				b.Fatalf("iteration %d: not applied after 30s (status: %+v)", i, agent.Status().LastError)
			}
			time.Sleep(100 * time.Microsecond)
		}
		samples = append(samples, time.Since(start))
	}
	b.StopTimer()
	slices.Sort(samples)
	pct := func(p float64) float64 {
		return float64(samples[min(len(samples)-1, int(p*float64(len(samples))))].Microseconds()) / 1000
	}
	b.ReportMetric(pct(0.50), "p50-ms")
	b.ReportMetric(pct(0.99), "p99-ms")
	b.ReportMetric(float64(samples[len(samples)-1].Microseconds())/1000, "max-ms")
	b.ReportMetric(30_000, "upstream-avg-ms")
	b.ReportMetric(60_000, "upstream-max-ms")
}
