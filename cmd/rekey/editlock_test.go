package main

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/configsource"
)

// Rotates run at once on one file (two operators, a loop in a pipeline): each run either
// applied its edit on top of the previous one or said that the file changed and wrote
// nothing. None is lost: the file ends with exactly one new key per run that said it
// added one, each of them the key that run named.
func TestConcurrentRotates(t *testing.T) {
	const runs, rounds = 8, 10
	newKey := regexp.MustCompile(`new write key "([^"]+)"`)
	applied, changed := 0, 0
	for range rounds {
		path := writeConfig(t, "enc.yaml", "key1")
		outs, errs := make([]string, runs), make([]error, runs)
		start := make(chan struct{})
		var wg sync.WaitGroup
		for i := range runs {
			wg.Go(func() {
				<-start
				outs[i], errs[i] = run(t, "rotate", "--encryption-provider-config", path)
			})
		}
		close(start)
		wg.Wait()

		inFile := fileKeys(t, path)
		var added []string
		for i := range runs {
			switch m := newKey.FindStringSubmatch(outs[i]); {
			case errs[i] == nil && m != nil:
				added = append(added, m[1])
			case errors.Is(errs[i], configsource.ErrChanged) && strings.Contains(errs[i].Error(), "nothing was written"):
				changed++
			default:
				t.Fatalf("run %d: neither applied nor refused as changed: %v\n%s", i, errs[i], outs[i])
			}
		}
		applied += len(added)
		// The keys of the runs that wrote, each on top of the previous one, then key1.
		if len(inFile) != len(added)+1 || inFile[len(inFile)-1] != "key1" {
			t.Fatalf("%d runs said they added a key, the file has %v: an edit was lost", len(added), inFile)
		}
		for _, name := range added {
			if !slices.Contains(inFile, name) {
				t.Fatalf("a run said it added %q, the file has %v: its edit was lost", name, inFile)
			}
		}
	}
	t.Logf("%d rotates in %d rounds of %d at once: %d applied, %d refused because the file changed", runs*rounds, rounds, runs, applied, changed)
}

// The lock file sits next to the file a symbolic link names, is created 0600, outlives
// the edit, and a second edit waits for the first (and gives up with its context).
func TestEditLock(t *testing.T) {
	dir := t.TempDir()
	target := writeConfig(t, "enc.yaml", "key1")
	link := filepath.Join(dir, "link.yaml")
	if err := os.Symlink(target, link); err != nil {
		t.Fatal(err)
	}
	unlock, err := lockForEdit(t.Context(), link)
	if err != nil {
		t.Fatal(err)
	}
	fi, err := os.Stat(target + ".lock")
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Fatalf("lock file next to the link's target: %v, %v; want mode 0600", fi, err)
	}
	ctx, cancel := context.WithTimeout(t.Context(), 100*time.Millisecond)
	defer cancel()
	if _, err := lockForEdit(ctx, target); err == nil || !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("second lock while the first is held: %v, want it to wait until its context ends", err)
	}
	unlock()
	if _, err := os.Stat(target + ".lock"); err != nil {
		t.Fatalf("the lock file is gone after the edit: %v", err)
	}
	unlock, err = lockForEdit(t.Context(), target)
	if err != nil {
		t.Fatalf("lock after the first was released: %v", err)
	}
	unlock()
}

// The lock file is never reached through a symbolic link, and must be a regular file
// of the user running rekey: otherwise the edit is refused, saying why, and nothing is
// created or locked where the link points.
func TestEditLockRefusesWhatItDidNotCreate(t *testing.T) {
	t.Run("symbolic link", func(t *testing.T) {
		target := writeConfig(t, "enc.yaml", "key1")
		elsewhere := filepath.Join(t.TempDir(), "victim")
		if err := os.Symlink(elsewhere, target+".lock"); err != nil {
			t.Fatal(err)
		}
		_, err := lockForEdit(t.Context(), target)
		if err == nil || !strings.Contains(err.Error(), "is a symbolic link, which rekey does not follow") {
			t.Fatalf("lock through a symbolic link: %v, want a refusal naming the link", err)
		}
		if _, err := os.Lstat(elsewhere); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("the link's target was created: %v", err)
		}
	})
	t.Run("named pipe", func(t *testing.T) {
		target := writeConfig(t, "enc.yaml", "key1")
		if err := syscall.Mkfifo(target+".lock", 0o600); err != nil {
			t.Fatal(err)
		}
		if _, err := lockForEdit(t.Context(), target); err == nil || !strings.Contains(err.Error(), "not a regular file but a named pipe") {
			t.Fatalf("lock file that is a named pipe: %v, want a refusal", err)
		}
	})
	t.Run("directory", func(t *testing.T) {
		target := writeConfig(t, "enc.yaml", "key1")
		if err := os.Mkdir(target+".lock", 0o700); err != nil {
			t.Fatal(err)
		}
		if _, err := lockForEdit(t.Context(), target); err == nil || !strings.Contains(err.Error(), "not a regular file but a directory") {
			t.Fatalf("lock file that is a directory: %v, want a refusal", err)
		}
	})
	t.Run("another owner", func(t *testing.T) {
		target := writeConfig(t, "enc.yaml", "key1")
		unlock, err := lockForEdit(t.Context(), target) // creates it, ours
		if err != nil {
			t.Fatal(err)
		}
		unlock()
		const other = 65534 // nobody
		lock := func() error {
			_, err := lockForEdit(t.Context(), target)
			return err
		}
		if os.Geteuid() == 0 {
			// As root the file can really belong to someone else.
			if err := os.Chown(target+".lock", other, other); err != nil {
				t.Fatal(err)
			}
		} else {
			// Otherwise the file stays ours and rekey runs "as" another user.
			lock = func() error {
				_, err := lockForEditAs(t.Context(), target, other)
				return err
			}
		}
		if err := lock(); err == nil || !strings.Contains(err.Error(), "belongs to user id") || !strings.Contains(err.Error(), "not to the user running rekey") {
			t.Fatalf("lock file of another user: %v, want a refusal naming the owner", err)
		}
	})
}
