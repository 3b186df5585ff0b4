package e2e

import (
	"fmt"
	"net/http"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// TestClusterKMSPluginFaults: three apiservers, each with its own KMS v2 plugin (one
// keyring, kek-1 active and kek-2 known), a 3-member etcd, writers on every apiserver
// and the sampler reading every Secret through every apiserver, while the plugins
// misbehave as field plugins do:
//
//  1. a key-version flap on every plugin (Status and Encrypt report kek-2 for about a
//     Status interval, then kek-1 again): nothing is written or migrated under kek-2;
//  2. one plugin killed while serving: its apiserver stops being ready but serves every
//     read from its cached DEKs and every write inside the write window, /livez stays
//     up, the others stay ready; the plugin's return makes it ready again;
//  3. a real rotation to kek-2 (every Secret migrated), then every plugin back to kek-1
//     (A → B → A, which KMS v2 forbids): the reuse is refused and raised on every
//     apiserver, nothing is migrated back, and nothing becomes unreadable.
//
// No request fails and nothing is unreadable, lost or stale throughout.
// E2E_LONG (make e2e-long): the single-apiserver forms run by default
// (kms_keyid_test.go, kms_absent_test.go).
func TestClusterKMSPluginFaults(t *testing.T) {
	requireLong(t)
	requireClusterShim(t)
	b := newClusterBed(t, bedConfig{name: "cluster-kms-faults", objects: clusterObjects(t), coordination: true, plugins: true,
		// A 3 s Status interval: a flap the test ends at its first sighting never meets
		// the second confirmation.
		args: []string{"--kms-status-interval", "3s", "--kms-retry-interval", "250ms"},
		initial: func(b *clusterBed, i int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.KMSv2(kmsName, b.plugins[i].Endpoint))
		}})
	ctx := t.Context()
	kek2 := testbed.PluginKey{Name: "kek-2", Secret: testbed.RandomKey()}
	for _, p := range b.plugins {
		if err := testbed.WritePluginKeys(p.KeysFile, b.kek1, kek2); err != nil {
			t.Fatal(err)
		}
	}
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-1")); err != nil {
		t.Fatal(err)
	}
	shims := b.shims()
	hcs := make([]*http.Client, len(shims))
	for i, s := range shims {
		var err error
		if hcs[i], err = s.HTTPClient(true); err != nil {
			t.Fatal(err)
		}
	}
	metric := func(i int, name string) float64 {
		t.Helper()
		v, err := shimMetric(ctx, hcs[i], shims[i], name)
		if err != nil {
			t.Fatal(err)
		}
		return v
	}
	eachShim := func(what string, timeout time.Duration, check func(i int) error) {
		t.Helper()
		for i := range shims {
			eventually(t, timeout, 100*time.Millisecond, fmt.Sprintf("%s: %s", shims[i].Name, what), func() error { return check(i) })
		}
	}
	setFaults := func(faults map[string]any) {
		t.Helper()
		for _, p := range b.plugins {
			if err := p.SetFaults(ctx, faults); err != nil {
				t.Fatal(err)
			}
		}
	}
	l := b.startLoad()

	// 1. A key-version flap on every plugin, one after the other: each flaps until its
	// apiserver has seen kek-2 once (a candidate), so for about one Status interval,
	// less than the two confirmations a key id needs.
	for i, p := range b.plugins {
		if err := p.SetFaults(ctx, map[string]any{"activeKey": "kek-2"}); err != nil {
			t.Fatal(err)
		}
		eventually(t, 30*time.Second, 50*time.Millisecond, shims[i].Name+": kek-2 seen as a candidate key id", func() error {
			k, _, err := kmsStatusOf(ctx, shims[i], kmsName)
			if err != nil {
				return err
			}
			if k.CandidateKeyIDHash != state.KeyIDHash("kek-2") {
				return fmt.Errorf("key id %s, candidate %q", k.KeyIDHash, k.CandidateKeyIDHash)
			}
			return nil
		})
		if err := p.SetFaults(ctx, nil); err != nil {
			t.Fatal(err)
		}
	}
	eachShim("the flap counted", 30*time.Second, func(i int) error {
		if n := metric(i, "rekey_kmsv2_key_id_flaps_total"); n < 1 {
			return fmt.Errorf("rekey_kmsv2_key_id_flaps_total = %v", n)
		}
		return nil
	})
	if err := testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-1").Check(ctx); err != nil {
		t.Fatalf("after a key-version flap: %v; want nothing written or migrated under kek-2", err)
	}
	t.Logf("1. flap on every plugin: counted on every apiserver, nothing stored under kek-2")

	// 2. apiserver 2's plugin killed while serving, then back.
	downShim, down := shims[2], b.plugins[2]
	down.Kill()
	eventually(t, 30*time.Second, 100*time.Millisecond, downShim.Name+" not ready without its plugin", func() error {
		if err := downShim.Readyz(ctx); err == nil {
			return fmt.Errorf("%s is ready", downShim.Name)
		}
		return nil
	})
	if code, body := httpGet(t, hcs[2], downShim.URL+"/livez"); code != http.StatusOK {
		t.Errorf("%s /livez with its plugin gone: %d %s", downShim.Name, code, body)
	}
	for _, s := range shims[:2] {
		if err := s.Readyz(ctx); err != nil {
			t.Errorf("%s not ready while another apiserver's plugin is gone: %v", s.Name, err)
		}
	}
	time.Sleep(5 * time.Second) // the writers and the sampler go on through it
	restarted, err := testbed.StartPlugin(ctx, bins.Plugin, filepath.Dir(down.KeysFile), filepath.Dir(down.Socket))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { restarted.Stop(5 * time.Second) })
	b.plugins[2] = restarted
	back := time.Now()
	rctx, cancel := contextWithTimeout(t, 30*time.Second)
	if err := downShim.WaitReady(rctx); err != nil {
		t.Fatal(err)
	}
	cancel()
	t.Logf("2. %s's plugin killed: not ready, the others ready; ready %v after the plugin's return", downShim.Name, time.Since(back).Round(time.Millisecond))

	// 3. A real rotation to kek-2, then back to kek-1 (A → B → A).
	setFaults(map[string]any{"activeKey": "kek-2"})
	cctx, cancel := contextWithTimeout(t, 90*time.Second)
	if err := testbed.WaitFor(cctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-2"),
		testbed.StatusProbe(b.shims(), clusterVerdictConverged)); err != nil {
		t.Fatal(err)
	}
	cancel()
	t.Logf("3. rotation to kek-2: every Secret migrated")
	setFaults(nil)
	eachShim("the reuse of kek-1 refused", 30*time.Second, func(i int) error {
		if n := metric(i, "rekey_kmsv2_key_id_reused"); n != 1 {
			return fmt.Errorf("rekey_kmsv2_key_id_reused = %v", n)
		}
		k, _, err := kmsStatusOf(ctx, shims[i], kmsName)
		if err != nil {
			return err
		}
		if k.ReusedKeyIDHash != state.KeyIDHash("kek-1") {
			return fmt.Errorf("status reusedKeyIDHash %q", k.ReusedKeyIDHash)
		}
		return nil
	})
	time.Sleep(5 * time.Second) // several Status intervals and migration checks
	if err := testbed.StoredKeyIDProbe(b.cli, b.secretsKey, kmsName, "kek-2").Check(ctx); err != nil {
		t.Fatalf("after the plugins went back to kek-1: %v; want nothing migrated back", err)
	}
	t.Logf("3. A → B → A: the reuse refused on every apiserver, nothing migrated back")
	b.finish(l)
	assertNoKeyMaterial(t, shims)
}

// assertNoKeyMaterial: the status documents name KMS key ids only as hashes.
func assertNoKeyMaterial(t *testing.T, shims []*testbed.Shim) {
	t.Helper()
	for _, s := range shims {
		doc, err := s.Status(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(string(doc.Raw), `"kek-1"`) || strings.Contains(string(doc.Raw), `"kek-2"`) {
			t.Errorf("%s's status document names a raw key id", s.Name)
		}
	}
}
