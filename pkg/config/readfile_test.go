//go:build unix

package config_test

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/config"
)

// readWithin calls ReadFile in a goroutine and fails the test if it has not returned
// within d: a FIFO used to block the reader (and the reload lock) until a writer came.
func readWithin(t *testing.T, path string, d time.Duration) error {
	t.Helper()
	done := make(chan error, 1)
	go func() {
		_, _, err := config.ReadFile(path)
		done <- err
	}()
	select {
	case err := <-done:
		return err
	case <-time.After(d):
		// The reader may never return (a FIFO without writer, /dev/zero read to the
		// end); it is left behind and ends with the test binary.
		t.Fatalf("ReadFile(%s) still blocked after %v", path, d)
		return nil
	}
}

func TestReadFileRefusesFIFO(t *testing.T) {
	path := filepath.Join(t.TempDir(), "config.fifo")
	if err := syscall.Mkfifo(path, 0o600); err != nil {
		t.Skipf("mkfifo: %v", err)
	}
	err := readWithin(t, path, 5*time.Second)
	if err == nil || !strings.Contains(err.Error(), "not a regular file") || !strings.Contains(err.Error(), "FIFO") {
		t.Fatalf("want a not-a-regular-file error naming the FIFO, got %v", err)
	}
	// Through a symlink too: the check is on what is opened.
	link := filepath.Join(filepath.Dir(path), "link")
	if err := os.Symlink(path, link); err != nil {
		t.Fatal(err)
	}
	if err := readWithin(t, link, 5*time.Second); err == nil || !strings.Contains(err.Error(), "not a regular file") {
		t.Fatalf("symlink to a FIFO: got %v", err)
	}
}

func TestReadFileRefusesDirectoryAndDevice(t *testing.T) {
	for path, kind := range map[string]string{t.TempDir(): "directory", "/dev/zero": "character device"} {
		if _, err := os.Stat(path); err != nil {
			continue
		}
		err := readWithin(t, path, 5*time.Second)
		if err == nil || !strings.Contains(err.Error(), "not a regular file (it is a "+kind+")") {
			t.Errorf("%s: want a not-a-regular-file error, got %v", path, err)
		}
	}
}

func TestReadFileBoundsTheSize(t *testing.T) {
	dir := t.TempDir()
	big := filepath.Join(dir, "big.yaml")
	if err := os.WriteFile(big, bytes.Repeat([]byte("#"), config.MaxFileSize+1), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, _, err := config.ReadFile(big); err == nil || !strings.Contains(err.Error(), "larger than 1048576 bytes") {
		t.Fatalf("want a too-large error, got %v", err)
	}
	atLimit := filepath.Join(dir, "limit.yaml")
	data := bytes.Repeat([]byte("#"), config.MaxFileSize)
	if err := os.WriteFile(atLimit, data, 0o600); err != nil {
		t.Fatal(err)
	}
	got, hash, err := config.ReadFile(atLimit)
	if err != nil || len(got) != config.MaxFileSize || hash != config.Hash(data) {
		t.Fatalf("a file of exactly MaxFileSize bytes: len %d, %v", len(got), err)
	}
}

// TestReadFileFollowsSymlinkChains: kubelet mounts configs as symlink chains
// (file → ..data/file → ..2026_11_23/file); they must keep working.
func TestReadFileFollowsSymlinkChains(t *testing.T) {
	dir := t.TempDir()
	data := doc("  - resources: [secrets]\n    providers:\n      - identity: {}\n")
	if err := os.Mkdir(filepath.Join(dir, "..2026_11_23"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "..2026_11_23", "config.yaml"), []byte(data), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("..2026_11_23", filepath.Join(dir, "..data")); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(filepath.Join("..data", "config.yaml"), filepath.Join(dir, "config.yaml")); err != nil {
		t.Fatal(err)
	}
	cfg, err := config.Load(filepath.Join(dir, "config.yaml"), config.Options{})
	if err != nil || cfg.Hash != config.Hash([]byte(data)) {
		t.Fatalf("Load through a symlink chain: %v", err)
	}
}
