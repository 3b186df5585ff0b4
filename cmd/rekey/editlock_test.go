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
	"testing"
	"time"
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
			case errors.Is(errs[i], errFileChanged) && strings.Contains(errs[i].Error(), "nothing was written"):
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
