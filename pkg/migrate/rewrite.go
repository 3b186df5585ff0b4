package migrate

// Rewriting the stale objects of one page: re-encrypt each through the current
// transformers and swap it in with a compare-and-swap on its ModRevision.

import (
	"context"
	"fmt"
	"unsafe"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"
)

// maxConflictRetries bounds how often one batch is tried again after concurrent
// changes before the migration leaves what is left of it to its next pass (the
// verifying re-scan finds it still stale).
const maxConflictRetries = 10

// splitAfterConflicts: a batch that conflicted this many times in a row is committed
// as two halves, each with retries of its own. Clients that walk through the objects
// in key order (a controller resyncing, writers going through their own objects) change
// another object of a 64-object batch between every two attempts: retried whole,
// 23–39 objects of such batches were left stale after ten attempts in a
// 10,000-Secret rotation, and the second pass they needed re-read every object.
const splitAfterConflicts = 2

// handlePage re-encrypts the stale objects of one page with the workers and returns
// when every object of the page is handled (so the checkpoint may move past it).
func (m *migrator) handlePage(ctx context.Context, tr value.Transformer, resource string, kvs []*mvccpb.KeyValue) error {
	workers := min(m.opts.Workers, (len(kvs)+m.opts.BatchSize-1)/m.opts.BatchSize)
	return fanOut(len(kvs), workers, func(lo, hi int) error {
		return m.handleChunk(ctx, tr, resource, kvs[lo:hi])
	})
}

// rewrite is one object to be swapped: its new value and what it must still be.
type rewrite struct {
	key    []byte
	val    []byte
	modRev int64
	lease  int64
	// readBack: val was decrypted back as current before the write (the write ledger
	// records only such rewrites).
	readBack bool
}

func (m *migrator) handleChunk(ctx context.Context, tr value.Transformer, resource string, kvs []*mvccpb.KeyValue) error {
	var batch []rewrite
	size := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := m.commit(ctx, tr, resource, batch)
		batch, size = batch[:0], 0
		return err
	}
	for _, kv := range kvs {
		if err := ctx.Err(); err != nil {
			return err
		}
		m.c.scanned.Add(1)
		rw, result, err := m.prepare(ctx, tr, kv)
		if err != nil {
			return err
		}
		if result != "" {
			m.count(resource, result)
			continue
		}
		if size+int(rw.size()) > m.opts.BatchBytes {
			if err := flush(); err != nil {
				return err
			}
		}
		batch = append(batch, rw)
		size += int(rw.size())
		if len(batch) >= m.writer.BatchLimit() {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// prepare decides about one stored value: a rewrite when it is stale, else the result
// to count (current or unreadable). A stale value is rewritten only if it decrypted to
// a stored Kubernetes object (checkStoredObject): anything else is counted unreadable
// and left as it is, so a wrong-key read can never be made permanent.
func (m *migrator) prepare(ctx context.Context, tr value.Transformer, kv *mvccpb.KeyValue) (rewrite, string, error) {
	dataCtx := value.DefaultContext(kv.Key)
	plain, stale, err := tr.TransformFromStorage(ctx, kv.Value, dataCtx)
	if isTransient(err) {
		// The plugin, not the value, failed: stop instead of counting it unreadable.
		return rewrite{}, "", transient(kv.Key, err)
	}
	if err != nil {
		m.log.V(2).Info("Leaving an object that cannot be decrypted", "key", string(kv.Key), "err", err)
		return rewrite{}, resultUnreadable, nil
	}
	if !stale {
		return rewrite{}, resultCurrent, nil
	}
	if err := checkStoredObject(plain); err != nil {
		m.log.Info("Leaving an object whose decrypted value is not a Kubernetes object; a wrong key may have read it", "key", string(kv.Key))
		return rewrite{}, resultUnreadable, nil
	}
	out, err := tr.TransformToStorage(ctx, plain, dataCtx)
	if isTransient(err) {
		return rewrite{}, "", transient(kv.Key, err)
	}
	if err != nil {
		return rewrite{}, "", fmt.Errorf("re-encrypting %s with the write key failed (nothing was written): %w", kv.Key, err)
	}
	// Read back before it is written: a value the configuration cannot read is never
	// swapped in, and one read back as current is what the verifying re-scan may count
	// without reading it again (writeLedger).
	_, staleAgain, err := tr.TransformFromStorage(ctx, out, dataCtx)
	if isTransient(err) {
		return rewrite{}, "", transient(kv.Key, err)
	}
	if err != nil {
		return rewrite{}, "", fmt.Errorf("re-encrypting %s: the value written with the write key cannot be read back (nothing was written); check the write provider: %w", kv.Key, err)
	}
	return rewrite{key: kv.Key, val: out, modRev: kv.ModRevision, lease: kv.Lease, readBack: !staleAgain}, "", nil
}

func (m *migrator) count(resource, result string) {
	switch result {
	case resultRewritten:
		m.c.rewritten.Add(1)
	case resultCurrent:
		m.c.current.Add(1)
	case resultGone:
		m.c.gone.Add(1)
	case resultUnreadable:
		m.c.unreadable.Add(1)
	}
	m.opts.Metrics.object(resource, result, 1)
}

// size is the bytes the rewrite adds to etcd's database (before its overhead).
func (rw rewrite) size() int64 { return int64(len(rw.key) + len(rw.val)) }

func putOp(rw rewrite) clientv3.Op {
	if rw.lease != 0 {
		// Keep the object's lease (e.g. events with a TTL); an expired lease deleted
		// the key, and the compare below then fails.
		return clientv3.OpPut(borrowString(rw.key), borrowString(rw.val), clientv3.WithLease(clientv3.LeaseID(rw.lease)))
	}
	return clientv3.OpPut(borrowString(rw.key), borrowString(rw.val))
}

// borrowString is b as a string without a copy, for etcd's client calls that take
// strings and copy them into the request at once (OpPut, OpGet, ModRevision): a
// string(b) there copied every re-encrypted value twice. b must not change while the
// call runs; nothing here writes to a rewrite's key or value after it is prepared.
func borrowString(b []byte) string {
	if len(b) == 0 {
		return ""
	}
	return unsafe.String(&b[0], len(b))
}

// commit writes a batch in one transaction that succeeds only if no object of the
// batch changed since it was read. If any did, the same transaction's else branch
// reads every object of the batch back: those that changed are prepared again from
// what it read (or counted, when gone or no longer stale), and the batch is tried
// again as one transaction with them, up to maxConflictRetries times, split in halves
// after splitAfterConflicts of them (each half tried again as one). Retrying every
// object on its own instead made a batch of 64 cost 65 transactions whenever a client
// had updated one of them: with writers on every apiserver of a 10,000-Secret
// rotation, windows of the migration achieved 900 of the 1,600 objects/s they were
// allowed, in 116–138 transactions where 25 did the same work.
func (m *migrator) commit(ctx context.Context, tr value.Transformer, resource string, batch []rewrite) error {
	for attempt := 0; len(batch) > 0; attempt++ {
		if attempt == maxConflictRetries {
			// Left stale; the verifying re-scan finds them and the next pass tries again.
			m.log.Info("Objects kept changing while they were being re-encrypted; leaving them to the next pass", "objects", len(batch), "first", string(batch[0].key))
			return nil
		}
		if attempt >= splitAfterConflicts && len(batch) > 1 {
			half := len(batch) / 2
			if err := m.commit(ctx, tr, resource, batch[:half]); err != nil {
				return err
			}
			return m.commit(ctx, tr, resource, batch[half:])
		}
		cmps := make([]clientv3.Cmp, len(batch))
		puts := make([]clientv3.Op, len(batch))
		gets := make([]clientv3.Op, len(batch))
		var size int64
		for i, rw := range batch {
			cmps[i] = clientv3.Compare(clientv3.ModRevision(borrowString(rw.key)), "=", rw.modRev)
			puts[i] = putOp(rw)
			gets[i] = clientv3.OpGet(borrowString(rw.key))
			size += rw.size()
		}
		resp, err := m.writer.Txn(ctx, len(batch), size, func(ctx context.Context) clientv3.Txn {
			return m.opts.Client.Txn(ctx).If(cmps...).Then(puts...).Else(gets...)
		})
		if err != nil {
			return fmt.Errorf("writing %d re-encrypted %s to etcd: %w", len(batch), resource, err)
		}
		if resp.Succeeded {
			m.ledger.record(resource, resp.Header.ClusterId, resp.Header.Revision, batch)
			m.c.rewritten.Add(int64(len(batch)))
			m.opts.Metrics.object(resource, resultRewritten, len(batch))
			return nil
		}
		if len(resp.Responses) != len(batch) {
			return fmt.Errorf("writing %d re-encrypted %s to etcd: the failed transaction answered %d reads, want %d", len(batch), resource, len(resp.Responses), len(batch))
		}
		again := make([]rewrite, 0, len(batch))
		for i, rw := range batch {
			kvs := resp.Responses[i].GetResponseRange().GetKvs()
			if len(kvs) == 1 && kvs[0].ModRevision == rw.modRev {
				again = append(again, rw) // unchanged: another object failed the batch
				continue
			}
			m.c.conflicts.Add(1)
			m.opts.Metrics.object(resource, resultConflict, 1)
			if len(kvs) == 0 {
				m.count(resource, resultGone)
				continue
			}
			next, result, err := m.prepare(ctx, tr, kvs[0])
			if err != nil {
				return err
			}
			if result != "" {
				m.count(resource, result)
				continue
			}
			again = append(again, next)
		}
		batch = again
	}
	return nil
}
