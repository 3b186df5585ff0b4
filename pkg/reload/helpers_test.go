package reload

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/base64"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/pkg/transformers"
)

var secrets = schema.GroupResource{Resource: "secrets"}

// key returns a deterministic 32-byte key, base64-encoded, for name.
func key(name string) string {
	sum := sha256.Sum256([]byte("test key " + name))
	return base64.StdEncoding.EncodeToString(sum[:])
}

// provider renders one provider entry: "aesgcm:k1,k2", "aescbc:k1", "secretbox:k1",
// "identity", "kms:name" (endpoint unix:///<name>.sock).
func provider(spec string) string {
	kind, arg, _ := strings.Cut(spec, ":")
	switch kind {
	case "identity":
		return "  - identity: {}\n"
	case "kms":
		return fmt.Sprintf("  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: unix:///tmp/%s.sock\n      timeout: 1s\n", arg, arg)
	}
	var b strings.Builder
	fmt.Fprintf(&b, "  - %s:\n      keys:\n", kind)
	for _, k := range strings.Split(arg, ",") {
		fmt.Fprintf(&b, "      - name: %s\n        secret: %s\n", k, key(k))
	}
	return b.String()
}

// rule renders one resources entry.
func rule(resources []string, providers ...string) string {
	var b strings.Builder
	quoted := make([]string, len(resources))
	for i, r := range resources {
		quoted[i] = strconv.Quote(r)
	}
	fmt.Fprintf(&b, "- resources: [%s]\n  providers:\n", strings.Join(quoted, ", "))
	for _, p := range providers {
		b.WriteString(provider(p))
	}
	return b.String()
}

// configYAML renders an EncryptionConfiguration from rules.
func configYAML(rules ...string) string {
	return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n" + strings.Join(rules, "")
}

// secretsConfig is the common case: secrets written with the first provider.
func secretsConfig(providers ...string) string {
	return configYAML(rule([]string{"secrets"}, providers...))
}

// writeRename replaces path atomically: write a temp file in the same directory, rename.
func writeRename(t testing.TB, path, content string) {
	t.Helper()
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, path); err != nil {
		t.Fatal(err)
	}
}

// fakePlugins stands in for KMS v2 plugins: health per provider name, set by the test.
// Every provider it builds runs a background goroutine until Close, as a real one does.
type fakePlugins struct {
	mu      sync.Mutex
	down    map[string]error
	changed chan struct{} // closed and replaced on every health change
	built   []*fakeKMS
	builds  atomic.Int64
	// blockSeal, when non-nil, holds every Seal until closed.
	blockSeal chan struct{}
}

func newFakePlugins() *fakePlugins {
	return &fakePlugins{down: map[string]error{}, changed: make(chan struct{})}
}

func (f *fakePlugins) setDown(name string, err error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if err == nil {
		delete(f.down, name)
	} else {
		f.down[name] = err
	}
	close(f.changed)
	f.changed = make(chan struct{})
}

func (f *fakePlugins) health(name string) (<-chan struct{}, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.changed, f.down[name]
}

func (f *fakePlugins) factory(_ context.Context, cfg *apiserver.KMSConfiguration, _ transformers.Options) (transformers.KMSProvider, error) {
	f.builds.Add(1)
	k := &fakeKMS{plugins: f, name: cfg.Name, endpoint: cfg.Endpoint,
		prefix: []byte(transformers.KMSv2Prefix + cfg.Name + ":"), stop: make(chan struct{}), done: make(chan struct{})}
	go func() { // the provider's status loop
		defer close(k.done)
		<-k.stop
	}()
	f.mu.Lock()
	f.built = append(f.built, k)
	f.mu.Unlock()
	return k, nil
}

func (f *fakePlugins) all() []*fakeKMS {
	f.mu.Lock()
	defer f.mu.Unlock()
	return append([]*fakeKMS(nil), f.built...)
}

var errConnClosing = errors.New("rpc error: code = Canceled desc = grpc: the client connection is closing")

type fakeKMS struct {
	plugins        *fakePlugins
	name, endpoint string
	prefix         []byte
	closed         atomic.Bool
	closeOnce      sync.Once
	stop, done     chan struct{}
	checks         atomic.Int64
}

func (k *fakeKMS) Prefix() []byte { return k.prefix }
func (k *fakeKMS) Name() string   { return k.name }

func (k *fakeKMS) Seal(ctx context.Context, plaintext []byte, _ value.Context) ([]byte, error) {
	k.plugins.mu.Lock()
	block := k.plugins.blockSeal
	k.plugins.mu.Unlock()
	if block != nil {
		<-block
	}
	if k.closed.Load() {
		return nil, errConnClosing
	}
	out := append(bytes.Clone(k.prefix), plaintext...)
	for i := len(k.prefix); i < len(out); i++ {
		out[i] ^= 0x5a
	}
	return out, nil
}

func (k *fakeKMS) Open(ctx context.Context, ciphertext []byte, _ value.Context) ([]byte, bool, error) {
	if k.closed.Load() {
		return nil, false, errConnClosing
	}
	out := bytes.Clone(ciphertext)
	for i := range out {
		out[i] ^= 0x5a
	}
	return out, false, nil
}

func (k *fakeKMS) Check(ctx context.Context) error {
	k.checks.Add(1)
	if k.closed.Load() {
		return errConnClosing
	}
	_, err := k.plugins.health(k.name)
	return err
}

func (k *fakeKMS) WaitReady(ctx context.Context) error {
	for {
		changed, err := k.plugins.health(k.name)
		if err == nil {
			return nil
		}
		select {
		case <-changed:
		case <-ctx.Done():
			return fmt.Errorf("%w (last error: %v)", ctx.Err(), err)
		}
	}
}

func (k *fakeKMS) Status() transformers.KMSStatus {
	_, err := k.plugins.health(k.name)
	st := transformers.KMSStatus{Name: k.name, Endpoint: k.endpoint, Healthy: err == nil,
		KeyIDHash: "sha256:" + hex.EncodeToString([]byte("keyid-"+k.name))}
	if err != nil {
		st.LastError = err.Error()
	}
	return st
}

func (k *fakeKMS) Close() {
	k.closeOnce.Do(func() {
		k.closed.Store(true)
		close(k.stop)
		<-k.done
	})
}

// fixture is an agent on a config file in a temp dir.
type fixture struct {
	t       testing.TB
	dir     string
	path    string
	plugins *fakePlugins
	reg     metrics.KubeRegistry
	agent   *Agent
}

func newFixture(t testing.TB, content string, mutate ...func(*Options)) *fixture {
	t.Helper()
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption-config.yaml")
	writeRename(t, path, content)
	return newFixtureAt(t, dir, path, mutate...)
}

// newFixtureAt starts an agent on an existing file.
func newFixtureAt(t testing.TB, dir, path string, mutate ...func(*Options)) *fixture {
	t.Helper()
	f := &fixture{t: t, dir: dir, path: path, plugins: newFakePlugins(), reg: metrics.NewKubeRegistry()}
	opts := f.options()
	for _, m := range mutate {
		m(&opts)
	}
	a, err := NewAgent(context.Background(), opts)
	if err != nil {
		t.Fatalf("NewAgent: %v", err)
	}
	f.agent = a
	t.Cleanup(a.Close)
	return f
}

func (f *fixture) options() Options {
	return Options{
		Path:              f.path,
		AutomaticReload:   true,
		PollInterval:      time.Hour, // tests that poll set it
		Debounce:          5 * time.Millisecond,
		GracePeriod:       50 * time.Millisecond,
		HealthGateTimeout: 2 * time.Second,
		Transformers:      transformers.Options{KMS: f.plugins.factory},
		Registry:          f.reg,
		APIServerID:       "apiserver-test-1",
		Logger:            ktesting.NewLogger(f.t, ktesting.NewConfig(ktesting.Verbosity(2))),
	}
}

// run starts the watch loop; it stops (and is waited for) when the returned function
// is called, at the latest at cleanup.
func (f *fixture) run() (stop func()) {
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() {
		defer close(done)
		f.agent.Run(ctx)
	}()
	stop = func() {
		cancel()
		<-done
	}
	f.t.Cleanup(stop)
	return stop
}

// write encrypts plaintext for gr through the agent.
func (f *fixture) write(gr schema.GroupResource, etcdKey, plaintext string) ([]byte, error) {
	return f.agent.TransformerForResource(gr).TransformToStorage(context.Background(), []byte(plaintext), value.DefaultContext(etcdKey))
}

func (f *fixture) mustWrite(gr schema.GroupResource, etcdKey, plaintext string) []byte {
	f.t.Helper()
	out, err := f.write(gr, etcdKey, plaintext)
	if err != nil {
		f.t.Fatalf("write %s: %v", etcdKey, err)
	}
	return out
}

func (f *fixture) read(gr schema.GroupResource, etcdKey string, stored []byte) (string, bool, error) {
	out, stale, err := f.agent.TransformerForResource(gr).TransformFromStorage(context.Background(), stored, value.DefaultContext(etcdKey))
	return string(out), stale, err
}

// writePrefix reports the prefix a write for gr now starts with ("" for identity).
func (f *fixture) writePrefix(gr schema.GroupResource) string {
	f.t.Helper()
	out := f.mustWrite(gr, "/registry/probe", "probe")
	if !bytes.HasPrefix(out, []byte("k8s:enc:")) {
		return ""
	}
	parts := strings.SplitN(string(out), ":", 6)
	return strings.Join(parts[:5], ":") + ":"
}

// eventually waits, with a deadline, for cond to hold.
func eventually(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(10 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after 10s waiting for %s", what)
		}
		time.Sleep(2 * time.Millisecond)
	}
}

// counter reads a counter or gauge from the registry, 0 when absent.
func (f *fixture) metric(name string, labels map[string]string) float64 {
	f.t.Helper()
	mfs, err := f.reg.Gather()
	if err != nil {
		f.t.Fatal(err)
	}
	for _, mf := range mfs {
		if mf.GetName() != name {
			continue
		}
	next:
		for _, m := range mf.GetMetric() {
			got := map[string]string{}
			for _, lp := range m.GetLabel() {
				got[lp.GetName()] = lp.GetValue()
			}
			for k, v := range labels {
				if got[k] != v {
					continue next
				}
			}
			if m.Counter != nil {
				return m.GetCounter().GetValue()
			}
			return m.GetGauge().GetValue()
		}
	}
	return 0
}

func sha256hex(s string) string {
	sum := sha256.Sum256([]byte(s))
	return hex.EncodeToString(sum[:])
}

func valueCtx(etcdKey string) value.Context { return value.DefaultContext(etcdKey) }
