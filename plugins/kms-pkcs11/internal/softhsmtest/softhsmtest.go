// Package softhsmtest creates a SoftHSM2 token in a test's temporary directory: its
// own softhsm2.conf (SOFTHSM2_CONF for the test's process and its children), a token
// initialised with softhsm2-util in the first free slot, and the user PIN. Without
// SoftHSM2 the test fails with the command that installs it: a skipped test would
// pass a machine on which the plugin was never exercised.
//
//	tok := softhsmtest.New(t)
//	cfg := token.Config{Module: tok.Module, TokenLabel: tok.Label, PIN: tok.PIN, KeyLabel: "kek", MaxSessions: softhsmtest.MaxSessions}
package softhsmtest

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

// InstallCommand installs what the tests need on Debian and Ubuntu.
const InstallCommand = "apt-get install -y softhsm2 opensc"

// MaxSessions is the session cap the tests run the plugin with: low, so that a session
// that is never returned to the pool starves the next seal within the session wait and
// fails the test instead of going unnoticed.
const MaxSessions = 3

// modules are where Debian, Ubuntu, Fedora and Homebrew put the library.
var modules = []string{
	"/usr/lib/softhsm/libsofthsm2.so",
	"/usr/lib/x86_64-linux-gnu/softhsm/libsofthsm2.so",
	"/usr/lib/aarch64-linux-gnu/softhsm/libsofthsm2.so",
	"/usr/lib64/pkcs11/libsofthsm2.so",
	"/usr/local/lib/softhsm/libsofthsm2.so",
}

// Token is a SoftHSM2 token made for one test.
type Token struct {
	Module string
	Label  string
	PIN    string
	// Conf is the SOFTHSM2_CONF path (already set in the test's environment).
	Conf string
}

// Module finds the SoftHSM2 library, or fails tb with the install command.
func Module(tb testing.TB) string {
	tb.Helper()
	if _, err := exec.LookPath("softhsm2-util"); err != nil {
		tb.Fatalf("SoftHSM2 is not installed (softhsm2-util is not on PATH); install it with: %s", InstallCommand)
	}
	for _, m := range modules {
		if _, err := os.Stat(m); err == nil {
			return m
		}
	}
	tb.Fatalf("SoftHSM2's library libsofthsm2.so is in none of %v; install it with: %s", modules, InstallCommand)
	return ""
}

// New creates a token labelled "rekey-test" with a random PIN.
func New(tb testing.TB) *Token {
	tb.Helper()
	mod := Module(tb)
	dir := tb.TempDir()
	tokens := filepath.Join(dir, "tokens")
	if err := os.Mkdir(tokens, 0o700); err != nil {
		tb.Fatal(err)
	}
	conf := filepath.Join(dir, "softhsm2.conf")
	body := fmt.Sprintf("directories.tokendir = %s\nobjectstore.backend = file\nlog.level = ERROR\nslots.removable = false\n", tokens)
	if err := os.WriteFile(conf, []byte(body), 0o600); err != nil {
		tb.Fatal(err)
	}
	tb.Setenv("SOFTHSM2_CONF", conf)
	t := &Token{Module: mod, Label: "rekey-test", PIN: "4711-test-pin", Conf: conf}
	out, err := exec.Command("softhsm2-util", "--init-token", "--free", "--label", t.Label, "--so-pin", "so-4711-pin", "--pin", t.PIN).CombinedOutput()
	if err != nil {
		tb.Fatalf("softhsm2-util --init-token: %v\n%s", err, out)
	}
	return t
}
