package guard

import (
	"context"
	"encoding/base64"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// The start-up check compares the configuration on disk with the persisted state of
// the last applied one: a configuration that drops key1 while secrets are stored
// under it is refused at start (with the count from a fresh inventory, or without
// one, an unknown count), nothing is saved, and the override lets it start.
func TestCheckStartupAgainstAppliedState(t *testing.T) {
	for _, store := range []string{"file", "etcd"} {
		t.Run(store, func(t *testing.T) {
			ctx := context.Background()
			cli := startEtcd(t)
			var state AppliedStateStore = FileAppliedState{Path: filepath.Join(t.TempDir(), "applied.json")}
			if store == "etcd" {
				state = EtcdAppliedState{Client: cli, Key: AppliedStatePrefix + "test-apiserver"}
			}
			cfgA, setA := setFor(t, "secrets", "aesgcm:key1")
			writeObjects(t, cli, setA, secrets, 5)
			start := func(cfg *config.Config, withInventory, override bool) error {
				o := StartupOptions{State: state, Config: cfg, Override: override, Logger: testLogger(t)}
				if withInventory {
					o.Client, o.Source, o.Resources = cli, migrate.FromSet(enctest.MustSet(t, cfg)), testResources()
				}
				return CheckStartup(ctx, o)
			}
			// First start: nothing persisted yet; the state of A is saved.
			if err := start(cfgA, true, false); err != nil {
				t.Fatalf("first start: %v", err)
			}
			saved, err := state.Load(ctx)
			if err != nil || saved == nil || saved.ConfigHash != cfgA.Hash {
				t.Fatalf("saved state = %+v, %v; want config %s", saved, err, cfgA.Hash)
			}
			checkNoKeyMaterial(t, state, cfgA)

			cfgB := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2"))
			otherSecret := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key1=other"))
			for _, tc := range []struct {
				name          string
				cfg           *config.Config
				withInventory bool
				want          string
			}{
				{"drop key1, counted", cfgB, true, `secrets: 5 objects are stored under aesgcm key "key1"`},
				{"drop key1, no inventory", cfgB, false, `secrets: aesgcm key "key1" (prefix "k8s:enc:aesgcm:v1:key1:") is the key this resource is written with now`},
				{"same name, other secret", otherSecret, true, `secrets: 5 objects are stored under aesgcm key "key1"`},
			} {
				err := start(tc.cfg, tc.withInventory, false)
				if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "refusing to start") || !strings.Contains(err.Error(), cfgA.Hash) {
					t.Fatalf("%s: start = %v, want a refusal containing %q", tc.name, err, tc.want)
				}
			}
			if s, _ := state.Load(ctx); s.ConfigHash != cfgA.Hash {
				t.Fatalf("a refused start saved its configuration (%s)", s.ConfigHash)
			}
			// A configuration that keeps key1 as a read key starts, and becomes the state.
			cfgMid := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2,key1"))
			if err := start(cfgMid, true, false); err != nil {
				t.Fatalf("key1 kept as a read key: %v", err)
			}
			// The override starts B anyway and records it.
			if err := start(cfgB, true, true); err != nil {
				t.Fatalf("with the override: %v", err)
			}
			if s, _ := state.Load(ctx); s.ConfigHash != cfgB.Hash {
				t.Fatalf("state after the override = %s, want %s", s.ConfigHash, cfgB.Hash)
			}
			if err := start(cfgB, true, false); err != nil {
				t.Fatalf("restart with the applied configuration: %v", err)
			}
		})
	}
}

func checkNoKeyMaterial(t *testing.T, state AppliedStateStore, cfg *config.Config) {
	t.Helper()
	var raw []byte
	switch s := state.(type) {
	case FileAppliedState:
		raw, _ = os.ReadFile(s.Path)
	case EtcdAppliedState:
		resp, err := s.Client.Get(context.Background(), s.Key)
		if err != nil || len(resp.Kvs) != 1 {
			t.Fatalf("state key: %v", err)
		}
		raw = resp.Kvs[0].Value
	}
	secret := cfg.Encryption.Resources[0].Providers[0].AESGCM.Keys[0].Secret
	key, _ := base64.StdEncoding.DecodeString(secret)
	if strings.Contains(string(raw), secret) || strings.Contains(string(raw), string(key)) || !strings.Contains(string(raw), `"fingerprint":`) && !strings.Contains(string(raw), `"fingerprint": `) {
		t.Fatalf("state %s holds key material or no fingerprint", raw)
	}
}

// A damaged state is a clear error, not a silent pass.
func TestAppliedStateDamaged(t *testing.T) {
	path := filepath.Join(t.TempDir(), "applied.json")
	if err := os.WriteFile(path, []byte("{not json"), 0o600); err != nil {
		t.Fatal(err)
	}
	err := CheckStartup(context.Background(), StartupOptions{State: FileAppliedState{Path: path}, Config: enctest.MustConfig(t, enctest.ConfigYAML("secrets", "identity"))})
	if err == nil || !strings.Contains(err.Error(), "not valid JSON") {
		t.Fatalf("err = %v", err)
	}
}

// A dropped key whose name contains ':' is still counted at start: the start-up
// inventory knows the state's prefixes, so it does not guess the name up to the ':'.
func TestCheckStartupKeyNameWithColon(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	state := FileAppliedState{Path: filepath.Join(t.TempDir(), "applied.json")}
	cfgA, setA := setFor(t, "secrets", "aesgcm:k:1")
	writeObjects(t, cli, setA, secrets, 3)
	start := func(cfg *config.Config) error {
		return CheckStartup(ctx, StartupOptions{State: state, Config: cfg, Client: cli, Source: migrate.FromSet(enctest.MustSet(t, cfg)), Resources: testResources(), Logger: testLogger(t)})
	}
	if err := start(cfgA); err != nil {
		t.Fatal(err)
	}
	err := start(enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:k2")))
	if !errors.Is(err, ErrRefused) || !strings.Contains(err.Error(), `secrets: 3 objects are stored under aesgcm key "k:1"`) {
		t.Fatalf("start = %v, want the 3 objects under k:1 named", err)
	}
}

// The applied-state file is replaced without changing its mode: an operator who made
// it group-readable (or tighter) keeps that across saves, and a new file is private.
func TestFileAppliedStateSaveKeepsMode(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	state := FileAppliedState{Path: filepath.Join(dir, "applied.json")}
	cfg := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key1"))
	if err := state.Save(ctx, NewAppliedState(cfg, nil, time.Now())); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(state.Path); err != nil {
		t.Fatal(err)
	} else if got := fi.Mode().Perm(); got != 0o600 {
		t.Fatalf("new state file mode = %o, want 600", got)
	}
	if err := os.Chmod(state.Path, 0o640); err != nil {
		t.Fatal(err)
	}
	next := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2,key1"))
	if err := state.Save(ctx, NewAppliedState(next, nil, time.Now())); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(state.Path)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != 0o640 {
		t.Errorf("mode after a save = %o, want the operator's 640", got)
	}
	if s, err := state.Load(ctx); err != nil || s.ConfigHash != next.Hash {
		t.Fatalf("loaded %+v, %v; want the saved state of %s", s, err, next.Hash)
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 1 {
		t.Errorf("the save left files behind: %v", entries)
	}
}
