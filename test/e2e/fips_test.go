package e2e

import (
	"bytes"
	"debug/buildinfo"
	"encoding/base64"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

// fipsEnv runs a shim in FIPS mode: under make test-fips the testbed already runs it
// with GODEBUG=fips140=only (a GOFIPS140 build); otherwise GODEBUG=fips140=on puts a
// default build in FIPS mode, so the refusals are checked in every run.
func fipsEnv() (env []string, mode string) {
	if testbed.FIPS() {
		return nil, "only"
	}
	return []string{"GODEBUG=fips140=on"}, "on"
}

func secretbox(name, secret string) string {
	return fmt.Sprintf("  - secretbox:\n      keys: [{name: %s, secret: %q}]\n", name, secret)
}

// wantFIPSRefusal checks the words of a FIPS refusal of secretbox "sb1": FIPS, the
// mode, the provider and its key, what to do; never a panic.
func wantFIPSRefusal(t *testing.T, what, text, mode string) {
	t.Helper()
	for _, w := range []string{"not approved in FIPS 140-3 mode", "FIPS 140-3 mode (" + mode + ")", `provider secretbox "sb1"`, "XSalsa20-Poly1305", "rekey rotate --provider aesgcm"} {
		if !strings.Contains(text, w) {
			t.Errorf("%s lacks %q:\n%s", what, w, text)
		}
	}
	if strings.Contains(text, "panic") {
		t.Errorf("%s shows a panic:\n%s", what, text)
	}
}

// FIPS mode refuses secretbox at start-up (the shim exits non-zero saying why) and at
// reload (the refused file is reported in the status document, the shim keeps serving
// with the configuration it had, and the Secrets it writes stay under aesgcm).
func TestFIPSRefusesSecretbox(t *testing.T) {
	ctx := t.Context()
	env, mode := fipsEnv()
	sb := base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{7}, 32))
	key1 := testbed.RandomKey()
	withSecretbox := encryptionConfig([]string{aesgcm("key1", key1), secretbox("sb1", sb)}, []string{identity})

	if testbed.FIPS() {
		// make test-fips: the programs are GOFIPS140 builds.
		for _, bin := range []string{bins.Shim, bins.Plugin} {
			bi, err := buildinfo.ReadFile(bin)
			if err != nil {
				t.Fatal(err)
			}
			var fipsModule string
			for _, s := range bi.Settings {
				if s.Key == "GOFIPS140" {
					fipsModule = s.Value
				}
			}
			// The setting names the module's version and hash: v1.0.0-c2097c7c.
			if !strings.HasPrefix(fipsModule, testbed.FIPSModule()) {
				t.Fatalf("%s is built with GOFIPS140=%q, want %s", bin, fipsModule, testbed.FIPSModule())
			}
		}
	}

	t.Run("start-up", func(t *testing.T) {
		dir := t.TempDir()
		config := filepath.Join(dir, "encryption.yaml")
		writeConfig(t, config, encryptionConfig([]string{secretbox("sb1", sb), identity}, []string{identity}))
		args, err := testbed.ShimArgs(testbed.ShimConfig{Dir: dir, EncryptionConfig: config, EtcdServers: []string{etcd.Endpoint}})
		if err != nil {
			t.Fatal(err)
		}
		p, err := testbed.StartEnv("shim", dir, bins.Shim, append(testbed.RunEnv(), env...), args...)
		if err != nil {
			t.Fatal(err)
		}
		log := refusedToStart(t, p, 60*time.Second, "with secretbox in FIPS mode", 8000)
		wantFIPSRefusal(t, "the start-up error", log, mode)
		if strings.Contains(log, sb) {
			t.Error("the refusal quotes key material")
		}
	})

	t.Run("reload", func(t *testing.T) {
		dir := t.TempDir()
		config := filepath.Join(dir, "encryption.yaml")
		writeConfig(t, config, encryptionConfig([]string{aesgcm("key1", key1), identity}, []string{identity}))
		s := startShim(t, testbed.ShimConfig{Dir: dir, EncryptionConfig: config, Env: env, Args: []string{"--storage-migration=false"}})
		st, raw := statusDoc[struct {
			reloadStatus
			FIPS bool `json:"fips"`
		}](t, s)
		if !st.FIPS {
			t.Fatalf("status does not show FIPS mode: %s", raw)
		}
		before := st.reloadStatus
		c := clientFor(t, s)
		writeConfig(t, config, withSecretbox)
		var refused reloadStatus
		eventually(t, 20*time.Second, 50*time.Millisecond, "refused reload", func() error {
			refused = getStatus(t, s)
			if refused.ReloadsFailed > before.ReloadsFailed && refused.LastError != "" {
				return nil
			}
			return fmt.Errorf("status %+v", refused)
		})
		wantFIPSRefusal(t, "the status document's lastError", refused.LastError, mode)
		if refused.ActiveConfigHash != before.ActiveConfigHash || refused.ReloadsSucceeded != before.ReloadsSucceeded {
			t.Errorf("the configuration changed: %+v, before %+v", refused, before)
		}
		if _, err := c.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "fips-after-refusal"}, Data: map[string][]byte{"k": []byte("v")}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
		cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		resp, err := cli.Get(ctx, "/registry/secrets/default/fips-after-refusal")
		if err != nil || len(resp.Kvs) != 1 || !bytes.HasPrefix(resp.Kvs[0].Value, []byte("k8s:enc:aesgcm:v1:key1:")) {
			t.Errorf("a Secret written after the refused reload is not under aesgcm key1: %v", err)
		}
		if log := s.Log(200000); strings.Contains(log, "panic") {
			t.Errorf("the shim's log shows a panic:\n%s", log)
		}
	})
}
