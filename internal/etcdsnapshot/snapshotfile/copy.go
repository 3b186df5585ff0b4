package snapshotfile

import (
	"bytes"
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"os"
)

// An etcd v3 snapshot file, as `etcdctl snapshot save` writes it
// (go.etcd.io/etcd/client/v3/snapshot), is the member's bbolt database followed by the
// sha256 of the database, which the member sends after it
// (etcdserver/api/v3rpc maintenanceServer.Snapshot). A file holds that hash when its
// size is 32 more than a multiple of 512 (client/v3/snapshot hasChecksum: a bbolt
// database is whole pages, a multiple of 512 bytes); `etcdutl snapshot restore` strips
// and checks it, and refuses a file without one unless --skip-hash-check, which also
// skips the check of a file with one (etcdutl/snapshot v3Manager.copyAndVerifyDB). The
// same rules apply here.
const (
	hashSize   = sha256.Size
	hashModulo = 512
	copyBuffer = 1 << 20
)

// hasHash reports whether a snapshot file of size bytes ends in etcd's sha256.
func hasHash(size int64) bool { return size%hashModulo == hashSize }

// copySnapshot copies the bbolt database of the snapshot file src into dst, checking
// etcd's trailing sha256 unless skipHashCheck, and returns the database's size.
//
// Everything after this reads dst, a private copy: the file the operator named may be
// truncated or rewritten while it is read (a backup job still writing it, a
// file system that lost it), and bbolt reading a memory-mapped file that shrinks gets
// SIGBUS. The copy is taken by read(2), which sees a short file as an early end of file.
func copySnapshot(ctx context.Context, src string, dst io.Writer, skipHashCheck bool) (int64, error) {
	f, err := openSnapshot(src)
	if err != nil {
		return 0, fmt.Errorf("reading snapshot: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return 0, err
	}
	if !st.Mode().IsRegular() {
		return 0, fmt.Errorf("%s is not a regular file (%s): name an etcd snapshot file", src, st.Mode().Type())
	}
	size := st.Size()
	hashed := hasHash(size)
	if !hashed && !skipHashCheck {
		return 0, &CorruptError{Path: src, Reason: fmt.Sprintf("it does not end in the sha256 that etcdctl snapshot save appends (it is %d bytes, not 32 more than a multiple of 512), "+
			"so it was cut short or is not a snapshot; a database copied from a member's data directory (member/snap/db) has no hash: read that with --skip-hash-check", size)}
	}
	dbSize := size
	if hashed {
		dbSize = size - hashSize
	}
	h := sha256.New()
	buf := make([]byte, copyBuffer)
	var copied int64
	for copied < dbSize {
		if err := ctx.Err(); err != nil {
			return 0, err
		}
		chunk := buf[:min(int64(len(buf)), dbSize-copied)]
		n, err := io.ReadFull(f, chunk)
		if n > 0 {
			_, _ = h.Write(chunk[:n])
			if _, werr := dst.Write(chunk[:n]); werr != nil {
				return 0, fmt.Errorf("writing the private copy of %s: %w (the copy needs as much room as the snapshot: point TMPDIR at a file system with room)", src, werr)
			}
			copied += int64(n)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, shrunk(src, size, copied)
		}
		if err != nil {
			return 0, fmt.Errorf("reading %s: %w", src, err)
		}
	}
	if !hashed {
		return dbSize, nil
	}
	var want [hashSize]byte
	if n, err := io.ReadFull(f, want[:]); err != nil {
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			return 0, shrunk(src, size, copied+int64(n))
		}
		return 0, fmt.Errorf("reading %s: %w", src, err)
	}
	if !skipHashCheck && !bytes.Equal(h.Sum(nil), want[:]) {
		return 0, &CorruptError{Path: src, Reason: "its bbolt database does not match the sha256 etcd appended when the snapshot was taken: " +
			"it was changed or damaged since; read an intact copy (--skip-hash-check reads it unverified)"}
	}
	return dbSize, nil
}

func shrunk(src string, size, read int64) error {
	return &CorruptError{Path: src, Reason: fmt.Sprintf("it ended after %d of its %d bytes while it was being copied: something is truncating or rewriting it; copy it somewhere it stays still, and read that", read, size)}
}

// privateDir makes a directory only this user can enter (os.MkdirTemp's mode 0700,
// which a umask can only narrow), in base (os.TempDir when "").
func privateDir(base string) (string, error) { return os.MkdirTemp(base, "rekey-snapshot-") }
