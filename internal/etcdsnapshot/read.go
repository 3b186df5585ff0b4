// Package etcdsnapshot reads an etcd snapshot file offline — the bbolt database that
// `etcdctl snapshot save` (or the client's Maintenance.Snapshot) writes — and tells
// which keys its stored objects need, and whether an encryption configuration can read
// them all. It never writes the file and needs no etcd.
package etcdsnapshot

import (
	"errors"
	"fmt"
	"time"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"
)

// etcd's on-disk layout (go.etcd.io/etcd/server/v3/storage): the "key" bucket maps a
// revision (8 bytes main, '_', 8 bytes sub; a deletion adds a trailing 't') to the
// mvccpb.KeyValue written at it.
const (
	keyBucket       = "key"
	revBytesLen     = 8 + 1 + 8
	markedRevLen    = revBytesLen + 1
	tombstoneMarker = 't'
)

// openTimeout bounds the wait for bbolt's file lock: a snapshot file is not held by a
// running etcd, so a lock held longer means the path is a live member's database.
const openTimeout = 5 * time.Second

// Latest calls fn with the latest value of every live key of the snapshot (deleted
// keys are skipped), newest revision first, and returns the snapshot's revision.
func Latest(path string, fn func(kv *mvccpb.KeyValue) error) (revision int64, err error) {
	db, err := bolt.Open(path, 0o400, &bolt.Options{ReadOnly: true, Timeout: openTimeout})
	if err != nil {
		return 0, fmt.Errorf("opening etcd snapshot %s: %w (is it a snapshot file written by etcdctl snapshot save?)", path, err)
	}
	defer db.Close()
	err = db.View(func(tx *bolt.Tx) error {
		b := tx.Bucket([]byte(keyBucket))
		if b == nil {
			return errors.New("it has no \"key\" bucket: not an etcd v3 database")
		}
		// Newest first: the first revision seen of a key is its latest one.
		seen := map[string]bool{}
		c := b.Cursor()
		for k, v := c.Last(); k != nil; k, v = c.Prev() {
			if len(k) != revBytesLen && len(k) != markedRevLen {
				return fmt.Errorf("it has a revision key of %d bytes: not an etcd v3 database", len(k))
			}
			var kv mvccpb.KeyValue
			if err := proto.Unmarshal(v, &kv); err != nil {
				return fmt.Errorf("a value at a revision does not decode: %w", err)
			}
			if revision == 0 {
				revision = kv.ModRevision
			}
			if seen[string(kv.Key)] {
				continue
			}
			seen[string(kv.Key)] = true
			if len(k) == markedRevLen && k[revBytesLen] == tombstoneMarker {
				continue // deleted at its latest revision
			}
			if err := fn(&kv); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return 0, fmt.Errorf("reading etcd snapshot %s: %w", path, err)
	}
	return revision, nil
}
