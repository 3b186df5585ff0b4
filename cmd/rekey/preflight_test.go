package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// preflightPlugins starts a real KMS v2 plugin per fault (plus a socket nobody listens
// on) in a directory short enough for unix socket paths.
func preflightPlugins(t *testing.T) (dir string, endpoints map[string]string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "pre")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	keys := filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(keys, []byte("keys:\n- {name: kek1, secret: "+secret('k')+"}\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	endpoints = map[string]string{"dead": "unix://" + filepath.Join(dir, "dead.sock")}
	for name, f := range map[string]kmsplugin.Faults{
		"healthy":   {},
		"nokeyid":   {StatusNoKeyID: true},
		"nodecrypt": {FailDecrypt: true},
	} {
		endpoints[name] = "unix://" + filepath.Join(dir, name+".sock")
		s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: endpoints[name], KeysFile: keys})
		if err != nil {
			t.Fatal(err)
		}
		s.SetFaults(f)
		t.Cleanup(s.Stop)
	}
	return dir, endpoints
}

// TestRotateKMSPreflight: `rotate --provider kms` calls the new plugin before it writes
// the file, and refuses (file untouched) a dead socket, a plugin without a key id and one
// whose Decrypt fails; --skip-preflight writes anyway with a warning.
func TestRotateKMSPreflight(t *testing.T) {
	_, endpoints := preflightPlugins(t)
	for _, tc := range []struct {
		plugin string
		skip   bool
		want   string // in the error; "" = success
	}{
		{plugin: "dead", want: "dial failed"},
		{plugin: "nokeyid", want: "no key id"},
		{plugin: "nodecrypt", want: "decrypt failed"},
		{plugin: "healthy"},
		{plugin: "dead", skip: true},
	} {
		t.Run(tc.plugin, func(t *testing.T) {
			path := writeConfig(t, "enc.yaml", "key1")
			before, _ := os.ReadFile(path)
			args := []string{"rotate", "--encryption-provider-config", path, "--provider", "kms", "--kms-name", "kms-new", "--kms-endpoint", endpoints[tc.plugin]}
			if tc.skip {
				args = append(args, "--skip-preflight")
			}
			out, err := run(t, args...)
			after, _ := os.ReadFile(path)
			if tc.want != "" {
				if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `"kms-new"`) ||
					!strings.Contains(err.Error(), endpoints[tc.plugin]) || !strings.Contains(err.Error(), "nothing was written") {
					t.Fatalf("rotate to the %s plugin: err = %v, want a refusal naming kms-new, its endpoint and %q\n%s", tc.plugin, err, tc.want, out)
				}
				if !bytes.Equal(before, after) {
					t.Fatal("a refused rotation changed the file")
				}
				return
			}
			if err != nil {
				t.Fatalf("rotate to the %s plugin: %v\n%s", tc.plugin, err, out)
			}
			if !strings.Contains(string(after), "kms-new") {
				t.Fatalf("the file has no kms-new provider:\n%s", after)
			}
			warned := strings.Contains(out, "WARNING: --skip-preflight") && strings.Contains(out, "not checked")
			if warned != tc.skip {
				t.Fatalf("skip %t, warning printed %t:\n%s", tc.skip, warned, out)
			}
		})
	}
}

// TestRotateWaitKMSPreflight: `rotate --wait --provider kms` calls the plugin before its
// first edit and stops, file untouched, when the plugin cannot decrypt.
func TestRotateWaitKMSPreflight(t *testing.T) {
	_, endpoints := preflightPlugins(t)
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	before, _ := os.ReadFile(path)
	startFakeApiservers(t, cli, path, srv.Endpoint)
	out, err := run(t, "rotate", "--encryption-provider-config", path, "--wait", "--etcd-servers", srv.Endpoint,
		"--progress", "plain", "--wait-interval", "50ms", "--wait-timeout", "1m",
		"--provider", "kms", "--kms-name", "kms-new", "--kms-endpoint", endpoints["nodecrypt"])
	if err == nil || !strings.Contains(err.Error(), "writing the first edit") || !strings.Contains(err.Error(), "decrypt failed") {
		t.Fatalf("rotate --wait to a plugin whose Decrypt fails: err = %v\n%s", err, out)
	}
	if after, _ := os.ReadFile(path); !bytes.Equal(before, after) {
		t.Fatal("the refused first edit changed the file")
	}
}

// TestCheckConfigKMSPreflight: check-config refuses a new configuration whose KMS v2
// plugin fails the preflight, before it looks at etcd, and accepts it with
// --skip-preflight and a warning.
func TestCheckConfigKMSPreflight(t *testing.T) {
	dir, endpoints := preflightPlugins(t)
	srv := etcdtest.Start(t)
	cur := writeConfig(t, "cur.yaml", "key1")
	next := func(plugin string) string {
		path := filepath.Join(dir, plugin+".yaml")
		body := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" +
			"      - kms: {apiVersion: v2, name: plug, endpoint: \"" + endpoints[plugin] + "\", timeout: 3s}\n" +
			"      - aesgcm:\n          keys:\n            - {name: key1, secret: " + secret('1') + "}\n"
		if err := os.WriteFile(path, []byte(body), 0o600); err != nil {
			t.Fatal(err)
		}
		return path
	}
	base := []string{"check-config", "--encryption-provider-config", cur, "--etcd-servers", srv.Endpoint, "--kms-wait", "2s"}
	for _, tc := range []struct{ plugin, want string }{
		{"dead", "dial failed"}, {"nokeyid", "no key id"}, {"nodecrypt", "decrypt failed"},
	} {
		out, err := run(t, append(base, "--new", next(tc.plugin))...)
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), `"plug"`) || !strings.Contains(err.Error(), "is refused") {
			t.Fatalf("check-config with the %s plugin: err = %v, want a refusal naming plug and %q\n%s", tc.plugin, err, tc.want, out)
		}
	}
	if out, err := run(t, append(base, "--new", next("healthy"))...); err != nil || !strings.Contains(out, "OK:") {
		t.Fatalf("check-config with a healthy plugin: %v\n%s", err, out)
	}
	out, err := run(t, append(base, "--new", next("nokeyid"), "--skip-preflight")...)
	if err != nil || !strings.Contains(out, "WARNING: --skip-preflight") || !strings.Contains(out, "not checked") {
		t.Fatalf("check-config --skip-preflight: %v\n%s", err, out)
	}
}
