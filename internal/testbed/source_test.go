package testbed

import (
	"context"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// The source file's changes reach every node's file, one round per change.
func TestFollowSourceAppliesEachEdit(t *testing.T) {
	dir := t.TempDir()
	files := []string{filepath.Join(dir, "a", "enc.yaml"), filepath.Join(dir, "b", "enc.yaml")}
	for _, f := range files {
		if err := InitSyncedFile(f, []byte("v0")); err != nil {
			t.Fatal(err)
		}
	}
	syncer, err := NewFileSyncer(SyncerConfig{Files: files, MaxDelay: 30 * time.Millisecond, Seed: 1})
	if err != nil {
		t.Fatal(err)
	}
	source := filepath.Join(dir, "source.yaml")
	if err := os.WriteFile(source, []byte("v0"), 0o600); err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	s := FollowSource(ctx, source, []byte("v0"), syncer)
	defer s.Stop()
	for _, v := range []string{"v1", "v2"} {
		if err := WriteFileAtomic(source, []byte(v)); err != nil {
			t.Fatal(err)
		}
		for {
			if r := s.Rounds(); len(r) > 0 && r[len(r)-1].Round != nil {
				select {
				case <-r[len(r)-1].Round.Done():
				case <-ctx.Done():
					t.Fatal(ctx.Err())
				}
				if all(files, v) {
					break
				}
			}
			if ctx.Err() != nil {
				t.Fatalf("%s never reached every file", v)
			}
			time.Sleep(10 * time.Millisecond)
		}
	}
	if n := len(s.Rounds()); n != 2 {
		t.Fatalf("%d rounds for 2 edits", n)
	}
}

func all(files []string, want string) bool {
	for _, f := range files {
		if b, err := os.ReadFile(f); err != nil || string(b) != want {
			return false
		}
	}
	return true
}
