package reload

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"net/http/httptest"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/internal/leakcheck"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

func TestMain(m *testing.M) { leakcheck.Main(m) }

const (
	gcmK1 = "k8s:enc:aesgcm:v1:k1:"
	gcmK2 = "k8s:enc:aesgcm:v1:k2:"
)

func TestNewAgentErrors(t *testing.T) {
	dir := t.TempDir()
	for name, content := range map[string]*string{
		"missing":  nil,
		"empty":    ptr(""),
		"invalid":  ptr("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources: [{resources: [secrets]}]\n"),
		"kms v1":   ptr(configYAML(rule([]string{"secrets"}, "aesgcm:k1")) + "- resources: [configmaps]\n  providers:\n  - kms: {name: a, endpoint: 'unix:///a.sock', cachesize: 10}\n"),
		"not yaml": ptr("{{{"),
	} {
		t.Run(name, func(t *testing.T) {
			path := filepath.Join(dir, strings.ReplaceAll(name, " ", "-")+".yaml")
			if content != nil {
				if err := os.WriteFile(path, []byte(*content), 0o600); err != nil {
					t.Fatal(err)
				}
			}
			a, err := NewAgent(context.Background(), Options{Path: path, AutomaticReload: true})
			if err == nil {
				a.Close()
				t.Fatal("NewAgent succeeded")
			}
			t.Log(err)
		})
	}
	if _, err := NewAgent(context.Background(), Options{}); err == nil {
		t.Fatal("NewAgent without a path succeeded")
	}
}

func ptr[T any](v T) *T { return &v }

// A KMS plugin that is down at start is not fatal: the agent starts and reports it.
func TestStartWithKMSPluginDown(t *testing.T) {
	f := &fixture{t: t, dir: t.TempDir(), plugins: newFakePlugins(), reg: metrics.NewKubeRegistry()}
	f.path = filepath.Join(f.dir, "c.yaml")
	writeRename(t, f.path, secretsConfig("kms:vault", "identity"))
	f.plugins.setDown("vault", errors.New("connection refused"))
	a, err := NewAgent(context.Background(), f.options())
	if err != nil {
		t.Fatalf("NewAgent with a plugin down: %v", err)
	}
	defer a.Close()
	err = a.HealthChecker().Check(httptest.NewRequest("GET", "/healthz/kms-providers", nil))
	if err == nil || !strings.Contains(err.Error(), `kms-provider-0: provider "vault": connection refused`) {
		t.Fatalf("health = %v", err)
	}
}

// An invalid new config (syntax, kind, version, unknown field, failed validation,
// masked wildcard) keeps the old transformers and hash and counts a failure.
func TestInvalidConfigKeepsOld(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	oldHash := f.agent.Status().ActiveConfigHash
	stored := f.mustWrite(secrets, "/registry/secrets/ns/a", "v1")
	bad := map[string]string{
		"syntax":        "apiVersion: [",
		"wrong kind":    strings.Replace(secretsConfig("aesgcm:k2"), "kind: EncryptionConfiguration", "kind: ConfigMap", 1),
		"wrong version": strings.Replace(secretsConfig("aesgcm:k2"), "apiserver.config.k8s.io/v1", "apiserver.config.k8s.io/v9", 1),
		"unknown field": strings.Replace(secretsConfig("aesgcm:k2"), "  providers:", "  pandas: 1\n  providers:", 1),
		"bad key size":  strings.Replace(secretsConfig("aesgcm:k2"), key("k2"), "c2hvcnQ=", 1),
		"masked":        configYAML(rule([]string{"*.*"}, "aesgcm:k2"), rule([]string{"secrets"}, "identity")),
	}
	failures := 0.0
	for name, content := range bad {
		t.Run(name, func(t *testing.T) {
			writeRename(t, f.path, content)
			if err := f.agent.Reload(context.Background()); err == nil {
				t.Fatal("Reload accepted an invalid config")
			}
			failures++
			if got := f.agent.Status().ActiveConfigHash; got != oldHash {
				t.Fatalf("hash changed to %s", got)
			}
			if p := f.writePrefix(secrets); p != gcmK1 {
				t.Fatalf("write prefix %q, want %q", p, gcmK1)
			}
			if v, _, err := f.read(secrets, "/registry/secrets/ns/a", stored); err != nil || v != "v1" {
				t.Fatalf("read = %q, %v", v, err)
			}
			st := f.agent.Status()
			if st.LastError == "" || st.LastErrorConfigHash != config.Hash([]byte(content)) {
				t.Fatalf("status does not record the failure: %+v", st)
			}
			if strings.Contains(st.LastError, key("k2")) {
				t.Fatal("status error leaks the key")
			}
			if got := f.metric("apiserver_encryption_config_controller_automatic_reloads_total",
				map[string]string{"status": "failure", "apiserver_id_hash": hashLabel("apiserver-test-1")}); got != failures {
				t.Fatalf("failure counter = %v, want %v", got, failures)
			}
		})
	}
	if got := f.metric("apiserver_encryption_config_controller_automatic_reloads_total", map[string]string{"status": "success"}); got != 0 {
		t.Fatalf("success counter = %v", got)
	}
	if got := f.metric("apiserver_encryption_config_controller_last_config_info", map[string]string{"hash": oldHash}); got != 1 {
		t.Fatalf("last_config_info{hash=old} = %v", got)
	}
}

// A valid, different config is swapped in; hash, success metric (with the hashed
// apiserver id), timestamp and last_config_info follow.
func TestValidConfigSwaps(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	old := f.mustWrite(secrets, "/registry/secrets/ns/a", "v1")
	next := secretsConfig("aesgcm:k2,k1")
	writeRename(t, f.path, next)
	before := time.Now()
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := f.writePrefix(secrets); p != gcmK2 {
		t.Fatalf("write prefix %q", p)
	}
	if v, stale, err := f.read(secrets, "/registry/secrets/ns/a", old); err != nil || v != "v1" || !stale {
		t.Fatalf("old value: %q stale=%v %v", v, stale, err)
	}
	hash := config.Hash([]byte(next))
	if got := f.agent.Status().ActiveConfigHash; got != hash {
		t.Fatalf("hash %s, want %s", got, hash)
	}
	id := map[string]string{"status": "success", "apiserver_id_hash": "sha256:" + sha256hex("apiserver-test-1")}
	if got := f.metric("apiserver_encryption_config_controller_automatic_reloads_total", id); got != 1 {
		t.Fatalf("success counter = %v", got)
	}
	if ts := f.metric("apiserver_encryption_config_controller_automatic_reload_last_timestamp_seconds", id); ts < float64(before.Unix()) {
		t.Fatalf("last timestamp = %v", ts)
	}
	if got := f.metric("apiserver_encryption_config_controller_last_config_info",
		map[string]string{"hash": hash, "apiserver_id_hash": id["apiserver_id_hash"]}); got != 1 {
		t.Fatalf("last_config_info = %v", got)
	}
}

// Unchanged content (rewritten, touched) builds nothing and records nothing.
func TestUnchangedIsNoop(t *testing.T) {
	content := secretsConfig("kms:vault", "aesgcm:k1")
	f := newFixture(t, content)
	if n := f.plugins.builds.Load(); n != 1 {
		t.Fatalf("builds = %d", n)
	}
	writeRename(t, f.path, content)
	now := time.Now().Add(time.Minute)
	_ = os.Chtimes(f.path, now, now)
	for range 3 {
		if err := f.agent.Reload(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	if n := f.plugins.builds.Load(); n != 1 {
		t.Fatalf("unchanged content built %d more providers", n-1)
	}
	for _, s := range []string{"success", "failure"} {
		if got := f.metric("apiserver_encryption_config_controller_automatic_reloads_total", map[string]string{"status": s}); got != 0 {
			t.Fatalf("%s counter = %v", s, got)
		}
	}
}

// The file deleted, empty, half written or unreadable keeps the old config; the
// good content that follows is applied.
func TestReadFailuresKeepOld(t *testing.T) {
	full := secretsConfig("aesgcm:k2", "aesgcm:k1")
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	cases := map[string]func(){
		"deleted": func() { _ = os.Remove(f.path) },
		"empty":   func() { writeRename(t, f.path, "") },
		"half written": func() {
			writeRename(t, f.path, full[:len(full)-20]) // cut inside the last key
		},
		"a directory": func() {
			_ = os.Remove(f.path)
			if err := os.Mkdir(f.path, 0o700); err != nil {
				t.Fatal(err)
			}
		},
	}
	for name, breakIt := range cases {
		t.Run(name, func(t *testing.T) {
			breakIt()
			if err := f.agent.Reload(context.Background()); err == nil {
				t.Fatal("Reload succeeded")
			}
			if p := f.writePrefix(secrets); p != gcmK1 {
				t.Fatalf("write prefix %q", p)
			}
			_ = os.RemoveAll(f.path)
			writeRename(t, f.path, secretsConfig("aesgcm:k1"))
			if err := f.agent.Reload(context.Background()); err != nil {
				t.Fatalf("restoring: %v", err)
			}
		})
	}
	writeRename(t, f.path, full)
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if p := f.writePrefix(secrets); p != gcmK2 {
		t.Fatalf("write prefix %q", p)
	}
}

// A new KMS plugin that fails its health gate: the old config keeps serving, the
// half-built providers are closed, a failure is counted; once the plugin is up the
// retry (with backoff, no file event) applies the change.
func TestHealthGateFailureThenRetry(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) { o.HealthGateTimeout = 100 * time.Millisecond })
	f.plugins.setDown("vault", errors.New("plugin not listening"))
	writeRename(t, f.path, secretsConfig("kms:vault", "aesgcm:k1"))
	err := f.agent.Reload(context.Background())
	if err == nil || !strings.Contains(err.Error(), `kms provider "vault"`) {
		t.Fatalf("Reload = %v", err)
	}
	if p := f.writePrefix(secrets); p != gcmK1 {
		t.Fatalf("write prefix %q", p)
	}
	for _, k := range f.plugins.all() {
		if !k.closed.Load() {
			t.Fatal("half-built KMS provider left open")
		}
	}
	if got := f.metric("apiserver_encryption_config_controller_automatic_reloads_total", map[string]string{"status": "failure"}); got != 1 {
		t.Fatalf("failure counter = %v", got)
	}
	if err := f.agent.HealthChecker().Check(nil); err != nil {
		t.Fatalf("the serving config has no KMS, health = %v", err)
	}

	f.run()
	f.plugins.setDown("vault", nil)
	eventually(t, "retry to apply the KMS config", func() bool {
		return f.writePrefix(secrets) == "k8s:enc:kms:v2:vault:"
	})
}

// By construction there is exactly one kms-providers check whatever the number of
// KMS providers, on /healthz and /readyz only (never /livez); it exists without KMS when
// reload is on and not when reload is off (upstream's rule). Upstream names one check
// per provider (kms-provider-<i>) only when reload is off and a KMS v1 provider is
// configured; rekey refuses KMS v1, so with reload off and several KMS v2 providers the
// single kms-providers check is upstream's name too (checked against kube-apiserver
// v1.37.2 in test/e2e/kubeapiserver_test.go).
func TestInstallInto(t *testing.T) {
	for _, tc := range []struct {
		name      string
		content   string
		reload    bool
		wantNames []string
	}{
		{"reload, two KMS", configYAML(rule([]string{"secrets"}, "kms:a", "kms:b"), rule([]string{"configmaps"}, "kms:c")), true, []string{"kms-providers"}},
		{"reload, no KMS", secretsConfig("aesgcm:k1"), true, []string{"kms-providers"}},
		{"no reload, KMS", secretsConfig("kms:a"), false, []string{"kms-providers"}},
		{"no reload, three KMS", configYAML(rule([]string{"secrets"}, "kms:a", "kms:b"), rule([]string{"configmaps"}, "kms:c")), false, []string{"kms-providers"}},
		{"no reload, no KMS", secretsConfig("aesgcm:k1"), false, nil},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := newFixture(t, tc.content, func(o *Options) { o.AutomaticReload = tc.reload })
			c := genericapiserver.NewConfig(serializer.CodecFactory{})
			base := map[string]int{"healthz": len(c.HealthzChecks), "readyz": len(c.ReadyzChecks), "livez": len(c.LivezChecks)}
			if err := f.agent.InstallInto(c); err != nil {
				t.Fatal(err)
			}
			if c.ResourceTransformers != f.agent {
				t.Fatal("ResourceTransformers not set")
			}
			kmsChecks := func(list []string) []string {
				var out []string
				for _, name := range list {
					if name == "kms-providers" || strings.HasPrefix(name, "kms-provider-") {
						out = append(out, name)
					}
				}
				return out
			}
			for endpoint, checks := range map[string][]string{"healthz": names(c.HealthzChecks), "readyz": names(c.ReadyzChecks)} {
				if got := kmsChecks(checks); !slices.Equal(got, tc.wantNames) {
					t.Fatalf("%s has kms checks %v, want %v", endpoint, got, tc.wantNames)
				}
			}
			if got := kmsChecks(names(c.LivezChecks)); len(got) != 0 || len(c.LivezChecks) != base["livez"] {
				t.Fatalf("livez changed: %v", names(c.LivezChecks))
			}
			_, hooked := c.PostStartHooks[PostStartHookName]
			if hooked != tc.reload {
				t.Fatalf("post-start hook registered = %v", hooked)
			}
			if err := f.agent.InstallInto(c); err == nil {
				t.Fatal("second InstallInto succeeded")
			}
		})
	}
}

func names[T interface{ Name() string }](checks []T) []string {
	var out []string
	for _, c := range checks {
		out = append(out, c.Name())
	}
	return out
}

// Add a provider in front, rewrite, remove the old one; then restart with
// the last applied config and read everything back.
func TestAddMigrateRemoveRestart(t *testing.T) {
	f := newFixture(t, secretsConfig("aescbc:old"))
	stored := map[string][]byte{"/registry/secrets/ns/a": f.mustWrite(secrets, "/registry/secrets/ns/a", "a")}

	writeRename(t, f.path, secretsConfig("secretbox:new", "aescbc:old"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	stored["/registry/secrets/ns/b"] = f.mustWrite(secrets, "/registry/secrets/ns/b", "b")
	if !strings.HasPrefix(string(stored["/registry/secrets/ns/b"]), "k8s:enc:secretbox:v1:new:") {
		t.Fatal("new write does not carry the new prefix")
	}
	// Storage migration: rewrite every stale value.
	for k, v := range stored {
		plain, stale, err := f.read(secrets, k, v)
		if err != nil {
			t.Fatal(err)
		}
		if stale {
			stored[k] = f.mustWrite(secrets, k, plain)
		}
	}
	final := secretsConfig("secretbox:new")
	writeRename(t, f.path, final)
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	check := func(a *Agent) {
		t.Helper()
		for k, v := range stored {
			out, stale, err := a.TransformerForResource(secrets).TransformFromStorage(context.Background(), v, valueCtx(k))
			if err != nil || stale || string(out) != k[len(k)-1:] {
				t.Fatalf("%s: %q stale=%v %v", k, out, stale, err)
			}
		}
	}
	check(f.agent)
	f.agent.Close()
	opts := f.options()
	opts.Registry = metrics.NewKubeRegistry() // a new process
	restarted, err := NewAgent(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer restarted.Close()
	if restarted.Status().ActiveConfigHash != config.Hash([]byte(final)) {
		t.Fatal("restart did not load the last applied config")
	}
	check(restarted)
}

// A reload to a key that cannot decrypt existing data: reads fail, writes work.
func TestUndecryptableAfterReload(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	old := f.mustWrite(secrets, "/registry/secrets/ns/a", "a")
	writeRename(t, f.path, secretsConfig("aesgcm:k2"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.read(secrets, "/registry/secrets/ns/a", old); err == nil || !strings.Contains(err.Error(), "no matching prefix found") {
		t.Fatalf("read of undecryptable value: %v", err)
	}
	// Same key name, different secret: the prefix matches but decryption fails.
	writeRename(t, f.path, strings.Replace(secretsConfig("aesgcm:k1"), key("k1"), key("other"), 1))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if _, _, err := f.read(secrets, "/registry/secrets/ns/a", old); err == nil {
		t.Fatal("read with the wrong key succeeded")
	}
	if p := f.writePrefix(secrets); p != gcmK1 {
		t.Fatalf("write prefix %q", p)
	}
}

// Wildcards after a reload: first matching entry wins, identity opt-out before a
// wildcard works, and overlapping wildcards are refused.
func TestWildcards(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	writeRename(t, f.path, configYAML(
		rule([]string{"configmaps"}, "identity"),
		rule([]string{"*.apps"}, "aescbc:apps"),
		rule([]string{"*.*"}, "aesgcm:all"),
	))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	for gr, want := range map[schema.GroupResource]string{
		{Resource: "configmaps"}:                   "",
		{Group: "apps", Resource: "deployments"}:   "k8s:enc:aescbc:v1:apps:",
		{Resource: "secrets"}:                      "k8s:enc:aesgcm:v1:all:",
		{Group: "batch", Resource: "jobs"}:         "k8s:enc:aesgcm:v1:all:",
		{Group: "example.com", Resource: "things"}: "k8s:enc:aesgcm:v1:all:",
	} {
		if got := f.writePrefix(gr); got != want {
			t.Errorf("%v writes %q, want %q", gr, got, want)
		}
	}
	hash := f.agent.Status().ActiveConfigHash
	writeRename(t, f.path, configYAML(rule([]string{"*.*"}, "aesgcm:all"), rule([]string{"*.apps"}, "identity")))
	if err := f.agent.Reload(context.Background()); err == nil {
		t.Fatal("masked wildcard accepted")
	}
	if f.agent.Status().ActiveConfigHash != hash {
		t.Fatal("config changed")
	}
}

// A key moves between two providers of the same type: later providers are still
// tried and the read is stale unless the first key read it.
func TestSamePrefixDifferentProviders(t *testing.T) {
	f := newFixture(t, secretsConfig("aescbc:k1"))
	old := f.mustWrite(secrets, "/registry/secrets/ns/a", "a")
	writeRename(t, f.path, secretsConfig("aescbc:k2", "aescbc:k1"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if v, stale, err := f.read(secrets, "/registry/secrets/ns/a", old); err != nil || v != "a" || !stale {
		t.Fatalf("read = %q stale=%v %v", v, stale, err)
	}
	fresh := f.mustWrite(secrets, "/registry/secrets/ns/b", "b")
	if v, stale, err := f.read(secrets, "/registry/secrets/ns/b", fresh); err != nil || v != "b" || stale {
		t.Fatalf("read = %q stale=%v %v", v, stale, err)
	}
}

// Guard vetoes a config; the old one keeps serving.
func TestGuardVeto(t *testing.T) {
	var calls int
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.Guard = func(cur, next *config.Config) error {
			calls++
			if cur == nil || next == nil {
				return errors.New("guard got nil")
			}
			if strings.Contains(string(mustRead(o.Path)), "k2") {
				return errors.New("key k1 still in use")
			}
			return nil
		}
	})
	writeRename(t, f.path, secretsConfig("aesgcm:k2"))
	if err := f.agent.Reload(context.Background()); err == nil || !strings.Contains(err.Error(), "key k1 still in use") {
		t.Fatalf("Reload = %v", err)
	}
	if p := f.writePrefix(secrets); p != gcmK1 || calls != 1 {
		t.Fatalf("prefix %q, guard calls %d", p, calls)
	}
}

func mustRead(path string) []byte {
	b, _ := os.ReadFile(path)
	return b
}

// The status document: JSON, the active hash, per-resource write provider and key or
// KMS key-id hash and health, the last error; no key material.
func TestStatusDocument(t *testing.T) {
	content := configYAML(rule([]string{"secrets"}, "kms:vault", "aesgcm:k1"), rule([]string{"configmaps"}, "aesgcm:k1"))
	f := newFixture(t, content)
	writeRename(t, f.path, "kind: Nope\nsecret: "+key("leak"))
	_ = f.agent.Reload(context.Background())

	srv := httptest.NewServer(f.agent.StatusHandler())
	defer srv.Close()
	resp, err := http.Get(srv.URL + StatusPath)
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 || resp.Header.Get("Content-Type") != "application/json" {
		t.Fatalf("status %d %s", resp.StatusCode, resp.Header.Get("Content-Type"))
	}
	var raw json.RawMessage
	if err := json.NewDecoder(resp.Body).Decode(&raw); err != nil {
		t.Fatal(err)
	}
	for _, secret := range []string{key("k1"), key("leak")} {
		if strings.Contains(string(raw), secret) {
			t.Fatalf("status leaks key material %s: %s", secret, raw)
		}
	}
	var st Status
	if err := json.Unmarshal(raw, &st); err != nil {
		t.Fatal(err)
	}
	if st.ActiveConfigHash != config.Hash([]byte(content)) || st.LoadedAt.IsZero() || st.LastError == "" || st.LastErrorAt.IsZero() || st.ReloadsFailed != 1 {
		t.Fatalf("status: %s", raw)
	}
	if len(st.Resources) != 2 || st.Resources[0].WriteProvider != "kms" || st.Resources[0].KMS == nil ||
		!strings.HasPrefix(st.Resources[0].KMS.KeyIDHash, "sha256:") || !st.Resources[0].KMS.Healthy ||
		st.Resources[1].WriteProvider != "aesgcm" || st.Resources[1].WriteKey != "k1" {
		t.Fatalf("resources: %s", raw)
	}
	if len(st.KMSProviders) != 1 || st.KMSProviders[0].Name != "vault" {
		t.Fatalf("kms providers: %s", raw)
	}
	t.Logf("%s", raw)
	if resp, err := http.Post(srv.URL, "text/plain", nil); err != nil || resp.StatusCode != http.StatusMethodNotAllowed {
		t.Fatalf("POST: %v %v", resp, err)
	} else {
		resp.Body.Close()
	}
}

// Through the agent: the single check follows the Set across a reload.
func TestHealthFollowsReload(t *testing.T) {
	f := newFixture(t, configYAML(rule([]string{"secrets"}, "kms:a"), rule([]string{"configmaps"}, "kms:b")))
	check := func() error { return f.agent.HealthChecker().Check(nil) }
	if err := check(); err != nil {
		t.Fatal(err)
	}
	writeRename(t, f.path, secretsConfig("kms:c"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	f.plugins.setDown("a", errors.New("a down")) // a is no longer configured
	if err := check(); err != nil {
		t.Fatalf("check probes a replaced provider: %v", err)
	}
	f.plugins.setDown("c", errors.New("c down"))
	// c's success is cached for 20 s; a fresh agent state is not needed: query the
	// provider's own view through the status document instead.
	if st := f.agent.Status(); st.KMSProviders[0].Healthy {
		t.Fatal("status shows c healthy")
	}
}

// Metrics can be left out; two agents cannot share one registry.
func TestMetricsRegistry(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) { o.Registry = nil })
	writeRename(t, f.path, secretsConfig("aesgcm:k2"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	reg := metrics.NewKubeRegistry()
	opts := f.options()
	opts.Registry = reg
	a, err := NewAgent(context.Background(), opts)
	if err != nil {
		t.Fatal(err)
	}
	defer a.Close()
	if b, err := NewAgent(context.Background(), opts); err == nil {
		b.Close()
		t.Fatal("second agent registered into the same registry")
	}
}

func TestDefaults(t *testing.T) {
	f := newFixture(t, configYAML(rule([]string{"secrets"}, "kms:a", "kms:b"), rule([]string{"configmaps"}, "aesgcm:k1")),
		func(o *Options) { o.GracePeriod, o.HealthGateTimeout = 0, 0 })
	cfg := f.agent.cur.Load().cfg
	// Two v2 providers with a 1 s timeout each.
	if got := f.agent.gracePeriod(cfg); got != MinGracePeriod {
		t.Fatalf("grace = %v", got)
	}
	if got := f.agent.healthGateTimeout(cfg); got != MinHealthGateTimeout {
		t.Fatalf("gate = %v", got)
	}
	big := strings.ReplaceAll(secretsConfig("kms:a", "kms:b"), "timeout: 1s", "timeout: 7s")
	c, err := config.Parse([]byte(big), "big", config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	if got := f.agent.gracePeriod(c); got != 28*time.Second {
		t.Fatalf("grace = %v", got)
	}
	if got := f.agent.healthGateTimeout(c); got != 14*time.Second {
		t.Fatalf("gate = %v", got)
	}
	var _ transformers.KMSProvider = (*fakeKMS)(nil)
}

// A file replaced while it is being loaded (a writer that truncated, then wrote the
// rest) is not applied in its intermediate state: the load starts over on what the file
// holds now, and no failure is recorded.
func TestChangedDuringLoadStartsOver(t *testing.T) {
	final := secretsConfig("aesgcm:k2")
	var rewrote bool
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.Guard = func(_, next *config.Config) error {
			if !rewrote {
				rewrote = true
				writeRename(t, o.Path, final)
			}
			return nil
		}
	})
	intermediate := secretsConfig("aescbc:k3")
	writeRename(t, f.path, intermediate)
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	st := f.agent.Status()
	if st.ActiveConfigHash != config.Hash([]byte(final)) || st.ReloadsSucceeded != 1 || st.ReloadsFailed != 0 {
		t.Fatalf("status: %+v", st)
	}
}

// Options.StatusExtras: each section is a top-level member of the document, read
// afresh on every request; a section named like one of the agent's members is left
// out and the agent's member stays.
func TestStatusExtras(t *testing.T) {
	var calls atomic.Int64
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.StatusExtras = func() map[string]any {
			n := calls.Add(1)
			return map[string]any{
				"storage":          map[string]any{"calls": n},
				"activeConfigHash": "not the agent's",
			}
		}
	})
	srv := httptest.NewServer(f.agent.StatusHandler())
	defer srv.Close()
	for want := int64(1); want <= 2; want++ {
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		var doc map[string]json.RawMessage
		err = json.NewDecoder(resp.Body).Decode(&doc)
		resp.Body.Close()
		if err != nil {
			t.Fatal(err)
		}
		var storage struct{ Calls int64 }
		if err := json.Unmarshal(doc["storage"], &storage); err != nil || storage.Calls != want {
			t.Fatalf("storage section %s (%v), want calls %d", doc["storage"], err, want)
		}
		var hash string
		if err := json.Unmarshal(doc["activeConfigHash"], &hash); err != nil || hash != f.agent.ActiveConfig().Hash {
			t.Fatalf("activeConfigHash %s, want the agent's %s", doc["activeConfigHash"], f.agent.ActiveConfig().Hash)
		}
		if _, ok := doc["resources"]; !ok {
			t.Fatalf("agent members missing: %v", doc)
		}
	}
	// Without extras the document is the plain struct.
	var st Status
	b, err := json.Marshal(Status{ConfigPath: "p"})
	if err != nil || json.Unmarshal(b, &st) != nil || st.ConfigPath != "p" || strings.Contains(string(b), "storage") {
		t.Fatalf("plain document %s %v", b, err)
	}
	if got := f.agent.Rules(); len(got) != 1 || got[0].WriteKey != "k1" {
		t.Fatalf("Rules() = %+v", got)
	}
}

// SetGuard gets the built, not yet serving Set of the new configuration: its veto
// keeps the old one serving; Applied is told of every swap and of nothing else.
func TestSetGuardAndApplied(t *testing.T) {
	var applied []string
	var veto error
	var sawSet *transformers.Set
	f := newFixture(t, secretsConfig("aesgcm:k1"), func(o *Options) {
		o.SetGuard = func(_ context.Context, cur, next *config.Config, set *transformers.Set) error {
			if cur == nil || next == nil || set == nil || set.Hash() != next.Hash {
				return errors.New("set guard got the wrong arguments")
			}
			sawSet = set
			return veto
		}
		o.Applied = func(cfg *config.Config) { applied = append(applied, cfg.Hash) }
	})
	veto = errors.New("the new plugin cannot decrypt stored data")
	writeRename(t, f.path, secretsConfig("aesgcm:k2", "aesgcm:k1"))
	if err := f.agent.Reload(context.Background()); err == nil || !strings.Contains(err.Error(), "cannot decrypt") {
		t.Fatalf("Reload = %v, want the set guard's veto", err)
	}
	if p := f.writePrefix(secrets); p != gcmK1 || len(applied) != 0 || sawSet == nil {
		t.Fatalf("after a veto: write prefix %q, applied %v, set guard called %v", p, applied, sawSet != nil)
	}
	veto = nil
	writeRename(t, f.path, secretsConfig("aesgcm:k2", "aesgcm:k1", "identity"))
	if err := f.agent.Reload(context.Background()); err != nil {
		t.Fatal(err)
	}
	if got := f.agent.ActiveConfig().Hash; len(applied) != 1 || applied[0] != got {
		t.Fatalf("applied = %v, want [%s]", applied, got)
	}
}

// A huge broken file is refused with an error the status document (and so the member
// record published from it) carries bounded: a few whole errors and a count of the rest.
func TestRefusedHugeFileGivesABoundedStatusError(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n")
	for i := 0; b.Len() < 80_000; i++ {
		fmt.Fprintf(&b, "  - resources: [r%d]\n    providers:\n      - aesgcm:\n          keys:\n            - {name: k%d, secret: bad}\n", i, i)
	}
	writeRename(t, f.path, b.String())
	err := f.agent.Reload(context.Background())
	if err == nil {
		t.Fatal("Reload accepted the broken file")
	}
	st := f.agent.Status()
	if len(err.Error()) < 20*errtext.MaxPublished {
		t.Fatalf("the refusal is only %d bytes long: the test shows nothing", len(err.Error()))
	}
	if n := len(st.LastError); n > errtext.MaxPublished+32 || !strings.Contains(st.LastError, "more errors)") {
		t.Fatalf("status error is %d bytes (%q…)", n, st.LastError[:min(n, 80)])
	}
}
