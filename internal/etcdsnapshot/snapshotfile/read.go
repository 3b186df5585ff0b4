// Package snapshotfile reads the "key" bucket of an etcd v3 snapshot file — the bbolt
// database that `etcdctl snapshot save` (or the client's Maintenance.Snapshot) writes,
// followed by its sha256 — verifying it before it is read: a corrupt, truncated or
// hostile file ends in a *CorruptError, never in a runtime fault.
//
//  1. The file is copied into a private temporary directory (0700, the copy 0600,
//     removed afterwards), checking etcd's trailing sha256 on the way (copy.go). The
//     rest reads the copy, which nothing truncates under it.
//  2. The copy's bbolt meta pages, and the pages of the trees bbolt walks to read the
//     key bucket, are checked with bounds-checked reads (bolt.go).
//  3. bbolt reads the copy in a child process, the reader (reader.go): a fault in
//     bbolt that the check did not foresee ends the child, and is reported.
//
// The package depends on bbolt and the standard library only, so that its fuzz target
// runs fast.
package snapshotfile

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
)

// etcd's on-disk layout (go.etcd.io/etcd/server/v3/storage/schema): the "key" bucket
// maps a revision (8 bytes main, '_', 8 bytes sub; a deletion adds a trailing 't') to
// the mvccpb.KeyValue written at it.
const (
	keyBucket       = "key"
	revBytesLen     = 8 + 1 + 8
	markedRevLen    = revBytesLen + 1
	tombstoneMarker = 't'
)

// IsTombstone reports whether a revision key of the key bucket marks a deletion.
func IsTombstone(revision []byte) bool {
	return len(revision) == markedRevLen && revision[revBytesLen] == tombstoneMarker
}

// Options say how a snapshot file is read.
type Options struct {
	// SkipHashCheck reads a file without checking etcd's trailing sha256, and one
	// without such a hash: a database copied from a member's data directory
	// (member/snap/db). As etcdutl snapshot restore --skip-hash-check.
	SkipHashCheck bool
	// Reader makes the command of the process that reads the bbolt database
	// (ServeReader). Required.
	Reader Reader
	// TempDir is where the private copy is made; "" is os.TempDir() ($TMPDIR).
	TempDir string
}

// damaged ends the reason of a CorruptError about the database's content.
const damaged = ": the file is damaged or is not an etcd v3 snapshot; read another copy of it"

// CorruptError is a snapshot file that is not an intact etcd v3 snapshot.
type CorruptError struct {
	Path   string
	Reason string
}

func (e *CorruptError) Error() string { return "corrupt snapshot: " + e.Path + ": " + e.Reason }

// Read calls pair with every revision key of the key bucket of the snapshot at path
// and the value stored at it, newest revision first. Revision keys are 17 bytes, 18
// for a deletion (IsTombstone). A file that is not an intact snapshot gives a
// *CorruptError; pair's error is returned as it is.
func Read(ctx context.Context, path string, o Options, pair func(revision, value []byte) error) error {
	if o.Reader == nil {
		return errors.New("snapshotfile: Options.Reader is nil: a snapshot is read in a child process")
	}
	dir, err := privateDir(o.TempDir)
	if err != nil {
		return fmt.Errorf("making a private directory for a copy of snapshot %s: %w (point TMPDIR at a writable directory)", path, err)
	}
	defer os.RemoveAll(dir)
	dbPath := filepath.Join(dir, "db")
	size, err := copyTo(ctx, path, dbPath, o.SkipHashCheck)
	if err != nil {
		return err
	}
	if err := validateFile(path, dbPath, size); err != nil {
		return err
	}
	return runReader(ctx, path, dbPath, size, o.Reader, func(k, v []byte) error {
		if len(k) != revBytesLen && len(k) != markedRevLen {
			return &CorruptError{Path: path, Reason: fmt.Sprintf("it has a revision key of %d bytes", len(k)) + damaged}
		}
		return pair(k, v)
	})
}

// copyTo copies the snapshot at path into a new file dbPath (0600).
func copyTo(ctx context.Context, path, dbPath string, skipHashCheck bool) (int64, error) {
	f, err := os.OpenFile(dbPath, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return 0, fmt.Errorf("making a private copy of snapshot %s: %w", path, err)
	}
	size, err := copySnapshot(ctx, path, f, skipHashCheck)
	if errors.Is(err, context.Canceled) || errors.Is(err, context.DeadlineExceeded) {
		err = fmt.Errorf("copying snapshot %s: %w", path, err)
	}
	if cerr := f.Close(); err == nil && cerr != nil {
		return 0, fmt.Errorf("writing the private copy of %s: %w", path, cerr)
	}
	return size, err
}

// validateFile runs validateBolt on the copy dbPath of the snapshot at path.
func validateFile(path, dbPath string, size int64) error {
	f, err := os.Open(dbPath)
	if err != nil {
		return fmt.Errorf("reading the private copy of %s: %w", path, err)
	}
	defer f.Close()
	if err := validateBolt(f, size); err != nil {
		return &CorruptError{Path: path, Reason: err.Error() + damaged}
	}
	return nil
}
