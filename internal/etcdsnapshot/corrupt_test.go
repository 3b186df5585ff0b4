package etcdsnapshot

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile"
	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile/snapshotfiletest"
	"github.com/rekey-io/rekey/internal/etcdtest"
)

const hashSize = snapshotfiletest.HashSize

// realSnapshot is a snapshot of an embedded etcd holding enough Secrets that its key
// bucket is a tree of several leaf pages under a branch page; 299 live keys.
func realSnapshot(t *testing.T) (path string, data []byte) {
	t.Helper()
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	for i := range 300 {
		if _, err := cli.Put(ctx, fmt.Sprintf("/registry/secrets/default/s%03d", i), "k8s:enc:aesgcm:v1:key1:"+strings.Repeat("x", 200)); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.Delete(ctx, "/registry/secrets/default/s000"); err != nil {
		t.Fatal(err)
	}
	return takeSnapshot(t, cli, "snapshot.db")
}

func wantCorrupt(t *testing.T, err error) {
	t.Helper()
	var ce *snapshotfile.CorruptError
	if !errors.As(err, &ce) || !strings.HasPrefix(err.Error(), "corrupt snapshot: ") {
		t.Fatalf("err = %v, want a corrupt snapshot error", err)
	}
	if strings.Contains(err.Error(), "goroutine ") || len(err.Error()) > 1000 {
		t.Fatalf("the error holds a stack dump or is too long: %v", err)
	}
}

func latest(t *testing.T, path string, o snapshotfile.Options) (int64, int, error) {
	t.Helper()
	n := 0
	rev, err := Latest(context.Background(), path, o, func(*mvccpb.KeyValue) error { n++; return nil })
	return rev, n, err
}

// A corpus of corrupted copies of a real etcd snapshot — truncated, random, with a
// wrong hash, empty, and damaged pages with a recomputed hash as a hostile writer would
// leave them — each gives a "corrupt snapshot:" error, with the hash checked or
// skipped; the intact snapshot, and the database whole without its hash when the check
// is skipped, read.
func TestCorruptSnapshots(t *testing.T) {
	path, snap := realSnapshot(t)
	if len(snap)%512 != hashSize {
		t.Fatalf("etcd's snapshot of %d bytes has no trailing sha256", len(snap))
	}
	db := snap[:len(snap)-hashSize]
	skip := readOpts()
	skip.SkipHashCheck = true

	rev, n, err := latest(t, path, readOpts())
	if err != nil || n != 299 || rev == 0 {
		t.Fatalf("intact snapshot: revision %d, %d live keys, %v; want 299", rev, n, err)
	}
	// A member's database (member/snap/db) has no hash: refused unless skipped.
	member := writeFile(t, "member.db", db)
	_, _, err = latest(t, member, readOpts())
	wantCorrupt(t, err)
	if !strings.Contains(err.Error(), "--skip-hash-check") {
		t.Fatalf("database without hash: %v, want an error naming --skip-hash-check", err)
	}
	if _, n, err := latest(t, member, skip); err != nil || n != 299 {
		t.Fatalf("database without hash, hash check skipped: %d keys, %v", n, err)
	}
	// A damaged meta page 0 with an intact twin reads, as bbolt reads it.
	if _, n, err := latest(t, writeFile(t, "meta0.db", snapshotfiletest.WithHash(snapshotfiletest.DamageMeta0(db))), readOpts()); err != nil || n != 299 {
		t.Fatalf("meta page 0 damaged, meta page 1 intact: %d keys, %v", n, err)
	}

	t.Run("empty", func(t *testing.T) {
		for _, o := range []snapshotfile.Options{readOpts(), skip} {
			_, _, err := latest(t, writeFile(t, "empty", nil), o)
			wantCorrupt(t, err)
		}
	})
	t.Run("wrong hash", func(t *testing.T) {
		bad := append([]byte(nil), snap...)
		bad[len(bad)-1] ^= 1
		_, _, err := latest(t, writeFile(t, "wrong-hash", bad), readOpts())
		wantCorrupt(t, err)
		if !strings.Contains(err.Error(), "sha256") {
			t.Fatalf("err = %v, want the sha256 named", err)
		}
		// Skipped, the database itself is intact.
		if _, n, err := latest(t, writeFile(t, "wrong-hash", bad), skip); err != nil || n != 299 {
			t.Fatalf("wrong hash skipped: %d keys, %v", n, err)
		}
	})
	t.Run("truncated", func(t *testing.T) {
		pageSize := snapshotfiletest.PageSize(db)
		for _, l := range []int{1, 31, 32, 100, 511, 544, 1000, pageSize, pageSize + 32, 2*pageSize + 32, len(snap) / 2, len(snap) - pageSize, len(snap) - 33, len(snap) - 1} {
			path := writeFile(t, "truncated", snap[:l])
			_, _, err := latest(t, path, readOpts())
			wantCorrupt(t, err)
			_, n, err := latest(t, path, skip)
			if l >= len(db) {
				// Only the hash was cut: unverified, the database is whole.
				if err != nil || n != 299 {
					t.Fatalf("cut to %d bytes, in the hash, hash check skipped: %d keys, %v", l, n, err)
				}
				continue
			}
			wantCorrupt(t, err)
		}
		// Cut at a page boundary and given a valid hash, as a hostile writer would:
		// the hash passes, the meta page's page count does not.
		for _, pages := range []int{1, 2, 3, len(db) / pageSize / 2, len(db)/pageSize - 1} {
			_, _, err := latest(t, writeFile(t, "truncated-rehashed", snapshotfiletest.WithHash(db[:pages*pageSize])), readOpts())
			wantCorrupt(t, err)
		}
	})
	t.Run("random bytes", func(t *testing.T) {
		rng := rand.New(rand.NewPCG(3, 4))
		for _, size := range []int{8, 512 + 32, 4096, 8192, 64 * 1024} {
			b := make([]byte, size)
			for i := range b {
				b[i] = byte(rng.Uint32())
			}
			for _, data := range [][]byte{b, snapshotfiletest.WithHash(b)} {
				for _, o := range []snapshotfile.Options{readOpts(), skip} {
					_, _, err := latest(t, writeFile(t, "random", data), o)
					wantCorrupt(t, err)
				}
			}
		}
	})
	corruptions, err := snapshotfiletest.Corruptions(db)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range corruptions {
		t.Run(c.Name, func(t *testing.T) {
			// The original hash no longer matches; a recomputed one does (a hostile
			// file); skipped, the database is all there is.
			stale := append(append([]byte(nil), c.DB...), snap[len(db):]...)
			_, _, err := latest(t, writeFile(t, "stale-hash", stale), readOpts())
			wantCorrupt(t, err)
			if !strings.Contains(err.Error(), "sha256") {
				t.Fatalf("err = %v, want the hash mismatch", err)
			}
			_, _, err = latest(t, writeFile(t, "hostile", snapshotfiletest.WithHash(c.DB)), readOpts())
			wantCorrupt(t, err)
			_, _, err = latest(t, writeFile(t, "member", c.DB), skip)
			wantCorrupt(t, err)
			// The page checks refuse it: bbolt and its process never see it.
			if strings.Contains(err.Error(), "bbolt failed") || strings.Contains(err.Error(), "bbolt cannot open") || strings.Contains(err.Error(), "reader process") {
				t.Fatalf("err = %v, want it refused before bbolt reads it", err)
			}
			t.Log(err)
		})
	}
}
