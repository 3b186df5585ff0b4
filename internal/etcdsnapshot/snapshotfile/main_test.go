package snapshotfile

import (
	"bufio"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime/debug"
	"testing"
	"time"
)

// readerEnv makes the test binary the reader process (ServeReader), the way the rekey
// binary is its own reader through a hidden subcommand.
const readerEnv = "REKEY_SNAPSHOTFILE_TEST_READER"

func TestMain(m *testing.M) {
	switch os.Getenv(readerEnv) {
	case "crash":
		// A reader that says hello and dies of a fault no recover() catches.
		w := bufio.NewWriter(os.Stdout)
		writeText(w, frameHello, readerProtocol)
		_ = w.Flush()
		debug.SetMaxStack(1 << 20)
		os.Exit(recurse(0))
	case "1":
		if len(os.Args) != 2 {
			fmt.Fprintln(os.Stderr, "reader: want one argument, the database")
			os.Exit(2)
		}
		// Limits small enough for a test to reach fast.
		if err := serveReader(os.Args[1], os.Stdout, readerLimits{maxHeap: 64 << 20, stall: 2 * time.Second, tick: 50 * time.Millisecond}); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// recurse overflows any stack (n counts up from 0 and never reaches -1).
func recurse(n int) int {
	if n == -1 {
		return 0
	}
	var pad [64]byte
	pad[n%64] = byte(n)
	return recurse(n+1) + int(pad[0])
}

// testReader runs this test binary as the reader.
func testReader(ctx context.Context, dbPath string) *exec.Cmd {
	exe, err := os.Executable()
	if err != nil {
		exe = os.Args[0]
	}
	cmd := exec.CommandContext(ctx, exe, dbPath)
	cmd.Env = append(os.Environ(), readerEnv+"=1")
	return cmd
}

func writeFile(t testing.TB, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
