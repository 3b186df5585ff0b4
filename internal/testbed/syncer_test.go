package testbed

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"
)

func readAll(t *testing.T, files []string) []string {
	t.Helper()
	out := make([]string, len(files))
	for i, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			t.Fatal(err)
		}
		out[i] = string(b)
	}
	return out
}

// Each file changes at its own moment: the files read old until their delay passed
// and new after, the round reports the last update, and the same seed draws the same
// delays (a failing run replays).
func TestFileSyncerDelaysAndReplay(t *testing.T) {
	for _, mode := range []SyncMode{SyncSymlinkSwap, SyncRename} {
		dir := t.TempDir()
		var files []string
		for i := range 4 {
			files = append(files, filepath.Join(dir, "node"+string(rune('a'+i)), "encryption.yaml"))
			if err := InitSyncedFile(files[i], []byte("old")); err != nil {
				t.Fatal(err)
			}
		}
		var logMu sync.Mutex
		var logs []string
		logf := func(f string, a ...any) {
			logMu.Lock()
			logs = append(logs, f)
			logMu.Unlock()
		}
		s, err := NewFileSyncer(SyncerConfig{Files: files, MinDelay: 50 * time.Millisecond, MaxDelay: 600 * time.Millisecond,
			Mode: mode, Seed: 42, Logf: logf})
		if err != nil {
			t.Fatal(err)
		}
		r := s.Apply(t.Context(), []byte("new"))
		first := slices.Min(r.Delays)
		lastDelay := slices.Max(r.Delays)
		if lastDelay-first < 50*time.Millisecond {
			t.Fatalf("delays %v are too close to observe the order", r.Delays)
		}
		// Before the first delay: everything old.
		if got := readAll(t, files); !slices.Equal(got, []string{"old", "old", "old", "old"}) {
			t.Fatalf("mode %d: at once: %v", mode, got)
		}
		// Between the first and the last update: a mix.
		time.Sleep(first + (lastDelay-first)/2)
		mid := readAll(t, files)
		if !slices.Contains(mid, "new") || !slices.Contains(mid, "old") {
			t.Errorf("mode %d: half-way (delays %v): %v, want a mix", mode, r.Delays, mid)
		}
		last, err := r.Wait(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if got := readAll(t, files); !slices.Equal(got, []string{"new", "new", "new", "new"}) {
			t.Fatalf("mode %d: after the round: %v", mode, got)
		}
		if d := last.Sub(r.Started); d < lastDelay || d > lastDelay+500*time.Millisecond {
			t.Errorf("mode %d: last update at +%v, the longest delay was %v", mode, d, lastDelay)
		}
		for i := range files {
			if a := r.Applied(i); a.IsZero() || a.After(last) {
				t.Errorf("file %d applied at %v, last %v", i, a, last)
			}
		}
		if len(logs) == 0 || !strings.Contains(logs[0], "seed") {
			t.Errorf("the seed is not logged: %q", logs)
		}

		again, _ := NewFileSyncer(SyncerConfig{Files: files, MinDelay: 50 * time.Millisecond, MaxDelay: 600 * time.Millisecond, Mode: mode, Seed: 42})
		r2 := again.ApplyEach(t.Context(), func(int) []byte { return []byte("new") }, nil)
		if !slices.Equal(r2.Delays, r.Delays) {
			t.Errorf("seed 42 replayed delays %v, first run %v", r2.Delays, r.Delays)
		}
		if _, err := r2.Wait(t.Context()); err != nil {
			t.Fatal(err)
		}
	}
}

// The symlink layout is the kubelet's: the file is a link into ..data, ..data a link
// to a version directory, and an update leaves exactly one version behind.
func TestSyncedFileLayout(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "encryption.yaml")
	if err := InitSyncedFile(path, []byte("v1")); err != nil {
		t.Fatal(err)
	}
	if err := writeSynced(SyncSymlinkSwap, path, []byte("v2")); err != nil {
		t.Fatal(err)
	}
	if target, err := os.Readlink(path); err != nil || target != filepath.Join("..data", "encryption.yaml") {
		t.Fatalf("%s links to %q (%v)", path, target, err)
	}
	entries, _ := os.ReadDir(dir)
	var versions []string
	for _, e := range entries {
		if strings.HasPrefix(e.Name(), "..20") {
			versions = append(versions, e.Name())
		}
	}
	data, _ := os.Readlink(filepath.Join(dir, "..data"))
	if len(versions) != 1 || versions[0] != data {
		t.Fatalf("versions %v, ..data → %q", versions, data)
	}
	if b, _ := os.ReadFile(path); string(b) != "v2" {
		t.Fatalf("read %q", b)
	}
}

// Only the chosen files change; the others keep their content (a node whose kubelet
// is down).
func TestFileSyncerSubset(t *testing.T) {
	dir := t.TempDir()
	files := []string{filepath.Join(dir, "a"), filepath.Join(dir, "b"), filepath.Join(dir, "c")}
	s, err := NewFileSyncer(SyncerConfig{Files: files, MaxDelay: 20 * time.Millisecond, Mode: SyncRename, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Init([]byte("old")); err != nil {
		t.Fatal(err)
	}
	r := s.ApplyEach(t.Context(), func(i int) []byte { return []byte{'n', byte('0' + i)} }, []int{0, 2})
	if _, err := r.Wait(t.Context()); err != nil {
		t.Fatal(err)
	}
	if got := readAll(t, files); !slices.Equal(got, []string{"n0", "old", "n2"}) {
		t.Fatalf("got %v", got)
	}
	if r.Delays[1] != -1 || !r.Applied(1).IsZero() {
		t.Fatalf("skipped file has delay %v, applied %v", r.Delays[1], r.Applied(1))
	}
	if _, err := NewFileSyncer(SyncerConfig{Files: files, MinDelay: time.Second, MaxDelay: time.Millisecond}); err == nil {
		t.Fatal("an empty delay range was accepted")
	}
}
