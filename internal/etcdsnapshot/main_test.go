package etcdsnapshot

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile"
)

// readerEnv makes the test binary the snapshot reader process, the way the rekey
// binary is its own reader through a hidden subcommand.
const readerEnv = "REKEY_ETCDSNAPSHOT_TEST_READER"

func TestMain(m *testing.M) {
	if os.Getenv(readerEnv) == "1" {
		if len(os.Args) != 2 {
			fmt.Fprintln(os.Stderr, "reader: want one argument, the database")
			os.Exit(2)
		}
		if err := snapshotfile.ServeReader(os.Args[1], os.Stdout); err != nil {
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}

// readOpts reads with this test binary as the reader.
func readOpts() snapshotfile.Options {
	return snapshotfile.Options{Reader: func(ctx context.Context, dbPath string) *exec.Cmd {
		exe, err := os.Executable()
		if err != nil {
			exe = os.Args[0]
		}
		cmd := exec.CommandContext(ctx, exe, dbPath)
		cmd.Env = append(os.Environ(), readerEnv+"=1")
		return cmd
	}}
}

// takeSnapshot writes etcd's snapshot (database and sha256, as etcdctl snapshot save
// writes it) to a file and returns its path and bytes.
func takeSnapshot(t testing.TB, cli *clientv3.Client, name string) (string, []byte) {
	t.Helper()
	rc, err := cli.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer rc.Close()
	data, err := io.ReadAll(rc)
	if err != nil {
		t.Fatal(err)
	}
	return writeFile(t, name, data), data
}

func writeFile(t testing.TB, name string, data []byte) string {
	t.Helper()
	path := filepath.Join(t.TempDir(), name)
	if err := os.WriteFile(path, data, 0o600); err != nil {
		t.Fatal(err)
	}
	return path
}
