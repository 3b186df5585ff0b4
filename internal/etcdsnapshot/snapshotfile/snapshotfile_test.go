package snapshotfile

import (
	"bytes"
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile/snapshotfiletest"
)

func wantCorrupt(t *testing.T, err error) {
	t.Helper()
	var ce *CorruptError
	if !errors.As(err, &ce) || !strings.HasPrefix(err.Error(), "corrupt snapshot: ") {
		t.Fatalf("err = %v, want a corrupt snapshot error", err)
	}
	if strings.Contains(err.Error(), "goroutine ") || len(err.Error()) > 1000 {
		t.Fatalf("the error holds a stack dump or is too long: %v", err)
	}
}

// read counts the pairs of the snapshot at path.
func read(t *testing.T, path string, o Options) (int, error) {
	t.Helper()
	n := 0
	err := Read(context.Background(), path, o, func(k, v []byte) error { n++; return nil })
	return n, err
}

func corpus(t testing.TB, db []byte) []snapshotfiletest.Corruption {
	t.Helper()
	c, err := snapshotfiletest.Corruptions(db)
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// The intact database passes; every damaged one is refused by the validation alone,
// in this process, before bbolt is given it.
func TestValidateBoltRefusesTheCorpus(t *testing.T) {
	for _, pageSize := range []int{1024, 4096} {
		snap := snapshotfiletest.BoltSnapshot(t, 400, pageSize, 200)
		db := snap[:len(snap)-hashSize]
		if err := validateBolt(bytes.NewReader(db), int64(len(db))); err != nil {
			t.Fatalf("intact database, pages of %d: %v", pageSize, err)
		}
		if err := validateBolt(bytes.NewReader(snapshotfiletest.DamageMeta0(db)), int64(len(db))); err != nil {
			t.Fatalf("meta page 0 damaged, 1 intact (bbolt reads it): %v", err)
		}
		for _, c := range corpus(t, db) {
			if err := validateBolt(bytes.NewReader(c.DB), int64(len(c.DB))); err == nil {
				t.Errorf("pages of %d, %s: accepted", pageSize, c.Name)
			}
		}
	}
}

// A database that faults bbolt ends the reader process, not the caller: handed
// straight to the reader, past the validation, it gives a corrupt snapshot error.
func TestReaderProcessContainsFaults(t *testing.T) {
	snap := snapshotfiletest.BoltSnapshot(t, 400, 0, 200)
	db := snap[:len(snap)-hashSize]
	for _, c := range corpus(t, db) {
		switch c.Name {
		case "key bucket root page id wild", "key bucket root page id just beyond the end", "branch element page id wild", "leaf element key offset wild":
		default:
			continue
		}
		t.Run(c.Name, func(t *testing.T) {
			path := writeFile(t, "db", c.DB)
			err := runReader(context.Background(), "hostile.db", path, int64(len(c.DB)), testReader, func(k, v []byte) error { return nil })
			wantCorrupt(t, err)
			t.Log(err)
		})
	}
}

// A page loop bbolt would follow forever (a branch page whose last element is itself:
// its cursor's stack of pages grows without end) ends the reader by its heap limit,
// past the validation that refuses it first otherwise.
func TestReaderLoopIsStopped(t *testing.T) {
	snap := snapshotfiletest.BoltSnapshot(t, 400, 0, 200)
	db := snap[:len(snap)-hashSize]
	for _, c := range corpus(t, db) {
		if c.Name != "branch element pointing at its own page" {
			continue
		}
		if err := validateBolt(bytes.NewReader(c.DB), int64(len(c.DB))); err == nil || !strings.Contains(err.Error(), "reached twice") {
			t.Fatalf("validation: %v, want the loop refused", err)
		}
		path := writeFile(t, "db", c.DB)
		err := runReader(context.Background(), "loop.db", path, int64(len(c.DB)), testReader, func(k, v []byte) error { return nil })
		wantCorrupt(t, err)
		if !strings.Contains(err.Error(), "loop in the database's pages") {
			t.Fatalf("err = %v, want the loop named", err)
		}
		t.Log(err)
		return
	}
	t.Fatal("no such corruption")
}

// A reader that dies of a runtime fault no recover() catches (here a stack overflow)
// is a corrupt snapshot, named by the fault.
func TestReaderCrashIsACorruptSnapshot(t *testing.T) {
	path := writeFile(t, "db", snapshotfiletest.BoltSnapshot(t, 10, 0, 10))
	reader := func(ctx context.Context, dbPath string) *exec.Cmd {
		cmd := testReader(ctx, dbPath)
		cmd.Env = append(cmd.Env, readerEnv+"=crash")
		return cmd
	}
	_, err := read(t, path, Options{Reader: reader})
	wantCorrupt(t, err)
	if !strings.Contains(err.Error(), "crashed the reader process") || !strings.Contains(err.Error(), "stack overflow") {
		t.Fatalf("err = %v, want the crash and its fault named", err)
	}
}

// The file named is read once, into a private copy (0600 in a 0700 directory, removed
// afterwards): truncating it while the database is read changes nothing.
func TestSnapshotIsReadFromAPrivateCopy(t *testing.T) {
	path := writeFile(t, "snapshot.db", snapshotfiletest.BoltSnapshot(t, 400, 0, 200))
	var copyPath string
	reader := func(ctx context.Context, dbPath string) *exec.Cmd {
		copyPath = dbPath
		if err := os.Truncate(path, 4096); err != nil {
			t.Error(err)
		}
		if st, err := os.Stat(dbPath); err != nil || st.Mode().Perm() != 0o600 {
			t.Errorf("private copy %s: %v, %v; want mode 0600", dbPath, err, st)
		}
		if st, err := os.Stat(filepath.Dir(dbPath)); err != nil || st.Mode().Perm() != 0o700 {
			t.Errorf("private directory: %v, %v; want mode 0700", err, st)
		}
		return testReader(ctx, dbPath)
	}
	n, err := read(t, path, Options{Reader: reader})
	if err != nil || n != 400 {
		t.Fatalf("truncated while read: %d revisions, %v; want the 400 of the copy", n, err)
	}
	if _, err := os.Stat(filepath.Dir(copyPath)); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("private copy's directory left behind: %v", err)
	}
	// Truncated before it is copied, it is refused.
	_, err = read(t, path, Options{Reader: testReader})
	wantCorrupt(t, err)
}

// A live member's database is locked by etcd: refused, not copied torn.
func TestLockedDatabaseIsRefused(t *testing.T) {
	path := writeFile(t, "db", snapshotfiletest.BoltSnapshot(t, 10, 0, 10))
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX); err != nil {
		t.Skipf("no flock here: %v", err)
	}
	if _, err := read(t, path, Options{Reader: testReader}); err == nil || !strings.Contains(err.Error(), "locked") {
		t.Fatalf("err = %v, want the lock named", err)
	}
}

// A directory or a FIFO is not read (a FIFO would block, /dev/zero never end).
func TestNotARegularFileIsRefused(t *testing.T) {
	fifo := filepath.Join(t.TempDir(), "fifo")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{t.TempDir(), fifo} {
		if _, err := read(t, p, Options{Reader: testReader}); err == nil || !strings.Contains(err.Error(), "not a regular file") {
			t.Fatalf("%s: err = %v, want it refused as not a regular file", p, err)
		}
	}
}

// A reader that is not one (another binary, a missing subcommand) is not a corrupt
// snapshot.
func TestBrokenReaderIsNotACorruptSnapshot(t *testing.T) {
	path := writeFile(t, "db", snapshotfiletest.BoltSnapshot(t, 10, 0, 10))
	reader := func(ctx context.Context, _ string) *exec.Cmd {
		return exec.CommandContext(ctx, "/bin/sh", "-c", "echo unknown command >&2; exit 1")
	}
	_, err := read(t, path, Options{Reader: reader})
	var ce *CorruptError
	if err == nil || errors.As(err, &ce) || !strings.Contains(err.Error(), "did not start reading") || !strings.Contains(err.Error(), "unknown command") {
		t.Fatalf("err = %v, want the reader named as broken", err)
	}
}

// The callback's error stops the read and is returned as it is.
func TestCallbackErrorIsReturned(t *testing.T) {
	path := writeFile(t, "db", snapshotfiletest.BoltSnapshot(t, 400, 0, 200))
	stop := errors.New("stop")
	n := 0
	err := Read(context.Background(), path, Options{Reader: testReader}, func(k, v []byte) error {
		if n++; n == 3 {
			return stop
		}
		return nil
	})
	if err != stop || n != 3 {
		t.Fatalf("err = %v after %d pairs, want the callback's error after 3", err, n)
	}
}

// patch applies patches to a copy of db. A patch is a 2-byte offset (big endian,
// modulo db's length), a length byte n and n bytes written there; n 0 cuts db at the
// offset.
func patch(db, patches []byte) []byte {
	out := append([]byte(nil), db...)
	for len(patches) >= 3 && len(out) > 0 {
		off, n := (int(patches[0])<<8|int(patches[1]))%len(out), int(patches[2])
		patches = patches[3:]
		if n == 0 {
			out = out[:off]
			continue
		}
		n = min(n, len(patches))
		copy(out[off:], patches[:n])
		patches = patches[n:]
	}
	return out
}

// patches is the patch that turns db into d (same length).
func patches(db, d []byte) []byte {
	var out []byte
	for i := 0; i < len(d); i++ {
		if d[i] == db[i] {
			continue
		}
		j := i
		for j < len(d) && j-i < 255 && d[j] != db[j] {
			j++
		}
		out = append(out, byte(i>>8), byte(i), byte(j-i))
		out = append(out, d[i:j]...)
		i = j
	}
	return out
}

// The validation never panics, and bbolt never crashes on a database it accepts. The
// inputs are patches to an intact database (small inputs, fast to minimize, and
// damage a random byte string would rarely reach: a page id, a count, an offset).
func FuzzSnapshot(f *testing.F) {
	// Small pages and values keep the database short: a few KiB with a branch page.
	snap := snapshotfiletest.BoltSnapshot(f, 40, 1024, 8)
	db := snap[:len(snap)-hashSize]
	if len(db) > 1<<16 {
		f.Fatalf("the database is %d bytes, more than a patch offset reaches", len(db))
	}
	if err := validateBolt(bytes.NewReader(db), int64(len(db))); err != nil {
		f.Fatalf("the intact database: %v", err)
	}
	f.Add([]byte{})
	f.Add([]byte{0x10, 0x00, 0}) // cut
	for _, c := range corpus(f, db) {
		if p := patches(db, c.DB); len(p) <= 64 {
			f.Add(p)
		}
	}
	f.Fuzz(func(t *testing.T, p []byte) {
		data := patch(db, p)
		if validateBolt(bytes.NewReader(data), int64(len(data))) != nil {
			return
		}
		path := writeFile(t, "db", data)
		err := runReader(context.Background(), "fuzz.db", path, int64(len(data)), testReader, func(k, v []byte) error { return nil })
		if err != nil && strings.Contains(err.Error(), "crashed") {
			t.Fatalf("a database the validation accepted crashed bbolt: %v", err)
		}
	})
}
