package reload

import (
	"context"
	"errors"
	"path/filepath"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// In FIPS mode (injected through Options.Transformers.FIPS) an agent refuses to start
// on a configuration naming secretbox, and refuses a reload to one: the configuration
// in use keeps serving, the refusal names FIPS and the provider, and the status says
// FIPS. Nothing panics and nothing is sealed with secretbox.
func TestFIPSModeRefusesSecretboxAtStartAndReload(t *testing.T) {
	fips := func(o *Options) { o.Transformers.FIPS = transformers.FIPSOn }
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption-config.yaml")
	writeRename(t, path, secretsConfig("secretbox:sb1"))
	f := &fixture{t: t, dir: dir, path: path, plugins: newFakePlugins()}
	opts := f.options()
	fips(&opts)
	if a, err := NewAgent(context.Background(), opts); err == nil {
		a.Close()
		t.Fatal("an agent in FIPS mode started on secretbox")
	} else if !errors.Is(err, transformers.ErrNotFIPSApproved) || !strings.Contains(err.Error(), "secretbox") {
		t.Fatalf("start-up: err = %v, want a FIPS refusal naming secretbox", err)
	}

	g := newFixture(t, secretsConfig("aesgcm:k1"), fips)
	if st := g.agent.OwnStatus(); !st.FIPS {
		t.Fatal("the status does not say FIPS")
	}
	if v := g.metric("rekey_fips_mode", nil); v != 1 {
		t.Fatalf("rekey_fips_mode = %v in FIPS mode, want 1", v)
	}
	writeRename(t, g.path, secretsConfig("secretbox:sb1", "aesgcm:k1"))
	err := g.agent.Reload(context.Background())
	if !errors.Is(err, transformers.ErrNotFIPSApproved) {
		t.Fatalf("reload to secretbox: err = %v", err)
	}
	st := g.agent.OwnStatus()
	if st.ReloadsFailed != 1 || !strings.Contains(st.LastError, "FIPS 140-3") || !strings.Contains(st.LastError, "secretbox") {
		t.Fatalf("status after the refused reload: failed %d, last error %q", st.ReloadsFailed, st.LastError)
	}
	out, err := g.write(schema.GroupResource{Resource: "secrets"}, "/registry/secrets/ns/a", "payload")
	if err != nil || !strings.HasPrefix(string(out), "k8s:enc:aesgcm:v1:k1:") {
		t.Fatalf("after the refused reload the agent writes %q (%v), want aesgcm k1", out[:min(len(out), 24)], err)
	}

	// Without FIPS mode the same change applies.
	h := newFixture(t, secretsConfig("aesgcm:k1"))
	if h.agent.OwnStatus().FIPS {
		t.Fatal("the status says FIPS without it")
	}
	if v := h.metric("rekey_fips_mode", nil); v != 0 {
		t.Fatalf("rekey_fips_mode = %v without FIPS mode, want 0", v)
	}
	writeRename(t, h.path, secretsConfig("secretbox:sb1", "aesgcm:k1"))
	if err := h.agent.Reload(context.Background()); err != nil {
		t.Fatalf("reload to secretbox without FIPS mode: %v", err)
	}
}
