// Package etcdsnapshot reads an etcd snapshot file offline — the bbolt database that
// `etcdctl snapshot save` (or the client's Maintenance.Snapshot) writes — and tells
// which keys its stored objects need, and whether an encryption configuration can read
// them all. It needs no etcd and never writes the file. The file is verified before it
// is read, and read in a child process (package snapshotfile): a corrupt, truncated or
// hostile file gives a *snapshotfile.CorruptError.
package etcdsnapshot

import (
	"context"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile"
)

// Latest calls fn with the latest value of every live key of the snapshot at path
// (deleted keys are skipped), newest revision first, and returns the snapshot's
// revision. A file that is not an intact snapshot gives a *snapshotfile.CorruptError;
// fn's error is returned as it is.
func Latest(ctx context.Context, path string, o snapshotfile.Options, fn func(kv *mvccpb.KeyValue) error) (revision int64, err error) {
	// Newest first: the first revision seen of a key is its latest one.
	seen := map[string]bool{}
	err = snapshotfile.Read(ctx, path, o, func(rev, v []byte) error {
		var kv mvccpb.KeyValue
		if err := proto.Unmarshal(v, &kv); err != nil {
			return &snapshotfile.CorruptError{Path: path, Reason: fmt.Sprintf("a value at a revision does not decode: %v", err)}
		}
		if revision == 0 {
			revision = kv.ModRevision
		}
		if seen[string(kv.Key)] {
			return nil
		}
		seen[string(kv.Key)] = true
		if snapshotfile.IsTombstone(rev) {
			return nil // deleted at its latest revision
		}
		return fn(&kv)
	})
	if err != nil {
		return 0, err
	}
	return revision, nil
}
