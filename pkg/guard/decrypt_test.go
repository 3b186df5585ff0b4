package guard

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// A KMS v2 provider that keeps its name but points at a plugin with another keyring
// passes CheckChange (the keyring cannot be seen in the configuration); the decrypt
// guard reads one stored object per key id and refuses it, naming provider, key id
// hash, resource and count. The same keyring at a new socket is allowed, and a plugin
// that does not answer is reported as unavailable, not as unable to decrypt.
func TestDecryptGuardKMSKeyring(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	a := enctest.StartKMS(t, "kek1")
	cfgYAML := func(e *enctest.KMS) string {
		return "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" + e.ProviderYAML("plug")
	}
	cfgA := enctest.MustConfig(t, cfgYAML(a))
	setA := enctest.BuildReady(t, cfgYAML(a), a.Factory)
	writeObjects(t, cli, setA, secrets, 5)
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(setA), Resources: testResources()})
	if err != nil {
		t.Fatal(err)
	}
	ri := inv.Find("secrets")
	if ri == nil || len(ri.Buckets) != 1 || ri.Buckets[0].SampleKey == "" || ri.Buckets[0].KeyIDHash == "" {
		t.Fatalf("inventory buckets = %+v, want one KMS bucket with a sample key", ri)
	}
	keyIDHash := ri.Buckets[0].KeyIDHash
	store := &migrate.InventoryStore{}
	store.Set(inv)

	// Another keyring: the same key id name with another secret.
	otherKeys := filepath.Join(t.TempDir(), "other-keys.yaml")
	secret := make([]byte, 32)
	_, _ = rand.Read(secret)
	if err := os.WriteFile(otherKeys, []byte("keys:\n  - {name: kek1, secret: "+base64.StdEncoding.EncodeToString(secret)+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	b := enctest.StartPlugin(t, otherKeys)
	cfgB := enctest.MustConfig(t, cfgYAML(b))
	if vs := CheckChange(inv, cfgA, cfgB); len(vs) != 0 {
		t.Fatalf("CheckChange = %q; the configuration guard cannot see keyrings", vs)
	}
	setB := enctest.BuildReady(t, cfgYAML(b), a.Factory)
	override := false
	guard := NewDecrypt(DecryptOptions{Inventory: store, Client: func() *clientv3.Client { return cli }, Override: func() bool { return override }, Logger: testLogger(t)})
	err = guard(ctx, cfgA, cfgB, setB)
	if !errors.Is(err, ErrRefused) {
		t.Fatalf("other keyring: guard = %v, want a refusal", err)
	}
	for _, want := range []string{`secrets: 5 objects are stored under kms provider "plug" key id ` + keyIDHash, "cannot decrypt", "--" + OverrideFlag} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal %q does not contain %q", err, want)
		}
	}
	if strings.Contains(err.Error(), base64.StdEncoding.EncodeToString(secret)) || strings.Contains(err.Error(), "kek1") {
		t.Errorf("refusal %q names key material or a raw key id", err)
	}
	override = true
	if err := guard(ctx, cfgA, cfgB, setB); err != nil {
		t.Fatalf("with the override: %v", err)
	}
	override = false

	// The same keyring at a new socket decrypts.
	c := enctest.StartPlugin(t, a.KeysFile)
	cfgC := enctest.MustConfig(t, cfgYAML(c))
	if err := guard(ctx, cfgA, cfgC, enctest.BuildReady(t, cfgYAML(c), a.Factory)); err != nil {
		t.Fatalf("same keyring, new socket: %v", err)
	}

	// A plugin that stops answering after the health gate is unavailable, not wrong.
	d := enctest.StartPlugin(t, a.KeysFile)
	cfgD := enctest.MustConfig(t, cfgYAML(d))
	setD := enctest.BuildReady(t, cfgYAML(d), a.Factory)
	d.Server.Stop()
	fs, err := CheckDecrypt(ctx, inv, cli, cfgD, setTransformers{setD})
	if err != nil {
		t.Fatal(err)
	}
	if len(fs) != 1 || !fs[0].Unavailable || !strings.Contains(fs[0].String(), "unavailable") || strings.Contains(fs[0].String(), "cannot decrypt") {
		t.Fatalf("stopped plugin: failures = %v, want one reported as unavailable", fs)
	}

	// At start, the same check runs against a fresh inventory: the other keyring is
	// refused, the same keyring starts, and an unavailable plugin does not block a start.
	state := FileAppliedState{Path: filepath.Join(t.TempDir(), "applied.json")}
	startWith := func(cfg *config.Config, tr value.ResourceTransformers) error {
		return CheckStartup(ctx, StartupOptions{State: state, Config: cfg, Client: cli, Source: migrate.FromSet(setA), Resources: testResources(), Transformers: tr, Logger: testLogger(t)})
	}
	if err := startWith(cfgA, setTransformers{setA}); err != nil {
		t.Fatalf("start with A: %v", err)
	}
	if err := startWith(cfgB, setTransformers{setB}); !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), "cannot decrypt") {
		t.Fatalf("start with another keyring = %v, want a refusal", err)
	}
	if err := startWith(cfgD, setTransformers{setD}); err != nil {
		t.Fatalf("start with an unavailable plugin: %v", err)
	}
}
