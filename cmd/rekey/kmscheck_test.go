package main

import (
	"bytes"
	"encoding/base64"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"k8s.io/component-base/cli"

	"github.com/rekey-io/rekey/internal/kmscheck"
	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// Environment of the helper processes: the test binary re-run as rekey, or as a
// plugin that --plugin-command starts.
const (
	kmsCheckArgsEnv   = "REKEY_TEST_KMSCHECK_ARGS"
	kmsCheckKeysEnv   = "REKEY_TEST_KMSCHECK_PLUGIN_KEYS"
	kmsCheckFaultsEnv = "REKEY_TEST_KMSCHECK_PLUGIN_FAULTS"
)

// kmsCheckKeys writes a keys file of kms-a (active) and kms-b in a private directory
// short enough for a unix socket path, and returns the directory.
func kmsCheckKeys(t *testing.T) (dir, keys string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kc")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	keys = filepath.Join(dir, "keys.yaml")
	doc := fmt.Sprintf("keys:\n- name: kms-a\n  secret: %s\n- name: kms-b\n  secret: %s\n",
		base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{'a'}, 32)), base64.StdEncoding.EncodeToString(bytes.Repeat([]byte{'b'}, 32)))
	if err := os.WriteFile(keys, []byte(doc), 0o600); err != nil {
		t.Fatal(err)
	}
	return dir, keys
}

func startKMSCheckPlugin(t *testing.T, f kmsplugin.Faults) (*kmsplugin.Server, string) {
	t.Helper()
	dir, keys := kmsCheckKeys(t)
	ep := "unix://" + filepath.Join(dir, "p.sock")
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: ep, KeysFile: keys, Faults: f})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s, ep
}

// fastKMSCheck are flags that keep one kms-check under a second.
func fastKMSCheck() []string {
	return []string{"--calls", "4", "--observe", "100ms", "--timeout", "2s"}
}

func kmsCheckArgs(ep string, extra ...string) []string {
	return append(append([]string{"kms-check", "--endpoint", ep}, fastKMSCheck()...), extra...)
}

func TestKMSCheckHealthyPluginTable(t *testing.T) {
	_, ep := startKMSCheckPlugin(t, kmsplugin.Faults{})
	out, err := run(t, kmsCheckArgs(ep)...)
	if err != nil {
		t.Fatalf("kms-check of a healthy plugin: %v\n%s", err, out)
	}
	for _, want := range []string{"CHECK", "VERDICT", "key-id-agreement", "latency-decrypt", "p99_ms=", "0 failed", "--plugin-command"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "kms-a") {
		t.Errorf("output names a key id in clear:\n%s", out)
	}
}

func kmsCheckJSON(t *testing.T, out string) *kmscheck.Report {
	t.Helper()
	var r kmscheck.Report
	// The report comes first; an error message may follow it.
	if err := json.NewDecoder(strings.NewReader(out)).Decode(&r); err != nil {
		t.Fatalf("-o json is not JSON: %v\n%s", err, out)
	}
	return &r
}

func wantVerdict(t *testing.T, r *kmscheck.Report, name string, v kmscheck.Verdict) {
	t.Helper()
	c := r.Check(name)
	if c == nil || c.Verdict != v {
		t.Errorf("%s: %+v, want %s", name, c, v)
	}
}

func TestKMSCheckFixedKeyIDJSON(t *testing.T) {
	_, ep := startKMSCheckPlugin(t, kmsplugin.Faults{FixedKeyID: "arn:aws:kms:eu-west-1:111122223333:key/one"})
	out, err := run(t, kmsCheckArgs(ep, "-o", "json")...)
	if err != nil {
		t.Fatalf("kms-check of a fixed-id plugin: %v\n%s", err, out)
	}
	r := kmsCheckJSON(t, out)
	wantVerdict(t, r, kmscheck.CheckKeyIDStable, kmscheck.Pass)
	wantVerdict(t, r, kmscheck.CheckOldKeyIDs, kmscheck.NotChecked)
	if len(r.KeyIDHashes) != 1 || !strings.HasPrefix(r.KeyIDHashes[0], "sha256:") || strings.Contains(out, "arn:aws") {
		t.Errorf("key ids in the report: %v", r.KeyIDHashes)
	}
}

// A plugin that decrypts only with its current key, rotated while kms-check watches:
// old key ids fail, unless the plugin is named one version per process.
func TestKMSCheckOneVersionDecrypt(t *testing.T) {
	for _, named := range []bool{false, true} {
		s, ep := startKMSCheckPlugin(t, kmsplugin.Faults{DecryptActiveOnly: true})
		done := make(chan struct{})
		go func() {
			defer close(done)
			// Rotate once the observation has started: after the 4 measured calls.
			for s.Stats().Encrypt < 6 {
				time.Sleep(2 * time.Millisecond)
			}
			s.SetFaults(kmsplugin.Faults{DecryptActiveOnly: true, ActiveKey: "kms-b"})
		}()
		args := kmsCheckArgs(ep, "-o", "json", "--observe", "400ms")
		if named {
			args = append(args, "--one-version-per-process")
		}
		out, err := run(t, args...)
		<-done
		r := kmsCheckJSON(t, out)
		if named {
			if err != nil {
				t.Fatalf("named one version per process: %v", err)
			}
			wantVerdict(t, r, kmscheck.CheckOldKeyIDs, kmscheck.Warn)
			continue
		}
		if !errors.Is(err, errChecksFailed) || !strings.Contains(err.Error(), kmscheck.CheckOldKeyIDs) {
			t.Fatalf("err %v, want the old-key-ids-decrypt failure", err)
		}
		wantVerdict(t, r, kmscheck.CheckOldKeyIDs, kmscheck.Fail)
		wantVerdict(t, r, kmscheck.CheckKeyIDStable, kmscheck.Warn)
	}
}

func TestKMSCheckKeyIDReuse(t *testing.T) {
	s, ep := startKMSCheckPlugin(t, kmsplugin.Faults{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		for _, step := range []struct {
			after int64
			key   string
		}{{6, "kms-b"}, {8, "kms-a"}} {
			for s.Stats().Encrypt < step.after {
				time.Sleep(2 * time.Millisecond)
			}
			s.SetFaults(kmsplugin.Faults{ActiveKey: step.key})
		}
	}()
	out, err := run(t, kmsCheckArgs(ep, "-o", "json", "--observe", "400ms")...)
	<-done
	if err != nil {
		t.Fatalf("A → B → A with the same key: %v", err)
	}
	wantVerdict(t, kmsCheckJSON(t, out), kmscheck.CheckKeyIDReuse, kmscheck.Warn)
}

func TestKMSCheckUsageErrors(t *testing.T) {
	for name, args := range map[string][]string{
		"no endpoint":         {},
		"tcp endpoint":        {"--endpoint", "tcp://127.0.0.1:1"},
		"unknown flag":        {"--endpoint", "unix:///x.sock", "--bogus"},
		"bad output":          {"--endpoint", "unix:///x.sock", "-o", "yaml"},
		"no calls":            {"--endpoint", "unix:///x.sock", "--calls", "0"},
		"argument":            {"unix:///x.sock"},
		"command without ep":  {"--plugin-command", "my-plugin --socket /x.sock"},
		"non-positive window": {"--endpoint", "unix:///x.sock", "--observe", "0s"},
	} {
		code := -1
		cmd := newKMSCheckCommandExiting(func(c int) { code = c })
		var out bytes.Buffer
		cmd.SetOut(&out)
		cmd.SetErr(&out)
		cmd.SetArgs(args)
		if err := cmd.Execute(); err == nil || code != exitUsage {
			t.Errorf("%s: err %v, exit code %d, want a usage error and %d\n%s", name, err, code, exitUsage, out.String())
		}
	}
}

// TestKMSCheckHelperProcess is rekey (under kmsCheckArgsEnv) or a plugin (under
// kmsCheckKeysEnv) for the tests that need a process of their own; otherwise it skips.
func TestKMSCheckHelperProcess(t *testing.T) {
	if doc := os.Getenv(kmsCheckArgsEnv); doc != "" {
		var args []string
		if err := json.Unmarshal([]byte(doc), &args); err != nil {
			t.Fatal(err)
		}
		// The plugin a --plugin-command starts is this binary too: it must not be rekey.
		_ = os.Unsetenv(kmsCheckArgsEnv)
		root := newRootCommand()
		root.SetArgs(args)
		os.Exit(cli.Run(root))
	}
	if keys := os.Getenv(kmsCheckKeysEnv); keys != "" {
		var f kmsplugin.Faults
		if err := json.Unmarshal([]byte(os.Getenv(kmsCheckFaultsEnv)), &f); err != nil {
			t.Fatal(err)
		}
		listen := ""
		for i, a := range flag.Args() {
			if a == "--listen-addr" && i+1 < len(flag.Args()) {
				listen = flag.Args()[i+1]
			}
		}
		ctx, stop := signal.NotifyContext(t.Context(), syscall.SIGTERM)
		defer stop()
		if err := kmsplugin.Run(ctx, kmsplugin.Options{ListenAddr: listen, KeysFile: keys, Faults: f}); err != nil {
			t.Fatal(err)
		}
		os.Exit(0)
	}
	t.Skip("helper process of the kms-check tests")
}

// kmsCheckProcess runs the test binary as rekey with args and returns its standard
// output (standard error goes to the test log) and exit code.
func kmsCheckProcess(t *testing.T, env []string, args ...string) (string, int) {
	t.Helper()
	var stderr bytes.Buffer
	defer func() { t.Logf("rekey %s: stderr:\n%s", strings.Join(args, " "), stderr.String()) }()
	cmd := exec.Command(os.Args[0], "-test.run=^TestKMSCheckHelperProcess$")
	doc, _ := json.Marshal(args)
	cmd.Env = append(append(os.Environ(), kmsCheckArgsEnv+"="+string(doc)), env...)
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	var exit *exec.ExitError
	switch {
	case err == nil:
		return string(out), 0
	case errors.As(err, &exit):
		return string(out), exit.ExitCode()
	}
	t.Fatalf("cannot run rekey: %v", err)
	return "", 0
}

func TestKMSCheckExitCodes(t *testing.T) {
	_, healthy := startKMSCheckPlugin(t, kmsplugin.Faults{})
	_, broken := startKMSCheckPlugin(t, kmsplugin.Faults{Annotations: map[string]string{"Not_A_Domain": "v"}})
	for _, c := range []struct {
		name string
		args []string
		code int
	}{
		{"healthy", kmsCheckArgs(healthy), 0},
		{"failed check", kmsCheckArgs(broken), 1},
		{"usage", []string{"kms-check", "--calls", "3"}, exitUsage},
	} {
		out, code := kmsCheckProcess(t, nil, c.args...)
		if code != c.code {
			t.Errorf("%s: exit code %d, want %d\n%s", c.name, code, c.code, out)
		}
	}
}

// --plugin-command: kms-check starts the plugin, restarts it for the restart checks and
// stops it at the end. The plugin flaps its key id on every start.
func TestKMSCheckPluginCommandStartupFlap(t *testing.T) {
	dir, keys := kmsCheckKeys(t)
	sock := filepath.Join(dir, "child.sock")
	faults, _ := json.Marshal(kmsplugin.Faults{StartupFlap: true})
	command := fmt.Sprintf("exec %s -test.run='^TestKMSCheckHelperProcess$' -- --listen-addr unix://%s", os.Args[0], sock)
	env := []string{kmsCheckKeysEnv + "=" + keys, kmsCheckFaultsEnv + "=" + string(faults)}
	args := append([]string{"kms-check", "--plugin-command", command, "-o", "json"}, fastKMSCheck()...)
	out, code := kmsCheckProcess(t, env, args...)
	if code != 1 {
		t.Fatalf("exit code %d, want 1 (start-up flap)\n%s", code, out)
	}
	r := kmsCheckJSON(t, out)
	wantVerdict(t, r, kmscheck.CheckStartupFlap, kmscheck.Fail)
	wantVerdict(t, r, kmscheck.CheckRestartKeyID, kmscheck.Pass)
	if r.Endpoint != "unix://"+sock {
		t.Errorf("endpoint %q, want the command's --listen-addr", r.Endpoint)
	}
	// The plugin was stopped: it removes its socket when it ends.
	if _, err := os.Stat(sock); !os.IsNotExist(err) {
		t.Errorf("the plugin's socket is still there after kms-check ended: %v", err)
	}
}
