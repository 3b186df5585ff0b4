package atomicfile

import (
	"os"
	"path/filepath"
	"testing"
)

func TestWriteFileCreatesWithPerm(t *testing.T) {
	p := filepath.Join(t.TempDir(), "state.json")
	if err := WriteFile(p, []byte("one"), 0o600); err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(p)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != 0o600 {
		t.Fatalf("mode = %o, want 600", got)
	}
	if b, _ := os.ReadFile(p); string(b) != "one" {
		t.Fatalf("content = %q", b)
	}
}

func TestWriteFileKeepsModeAndReplacesLinkTarget(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "real.yaml")
	if err := os.WriteFile(target, []byte("old"), 0o640); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.yaml")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(link, []byte("new"), 0o600); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the link was replaced by a file (%v)", err)
	}
	fi, _ := os.Stat(target)
	if got := fi.Mode().Perm(); got != 0o640 {
		t.Fatalf("mode = %o, want the existing 640", got)
	}
	if b, _ := os.ReadFile(target); string(b) != "new" {
		t.Fatalf("content = %q", b)
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 2 {
		t.Fatalf("left behind: %v", entries)
	}
}

func TestWriteFileFailureLeavesNoTemporaryFile(t *testing.T) {
	// A rename over a non-empty directory fails for every user, root included.
	dir := t.TempDir()
	p := filepath.Join(dir, "cfg.yaml")
	if err := os.MkdirAll(filepath.Join(p, "inside"), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := WriteFile(p, []byte("new"), 0o600); err == nil {
		t.Fatal("WriteFile over a non-empty directory succeeded")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 1 {
		t.Fatalf("a temporary file was left behind: %v", entries)
	}
	if _, err := os.Stat(filepath.Join(p, "inside")); err != nil {
		t.Fatalf("the old content is gone: %v", err)
	}
}
