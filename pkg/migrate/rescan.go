package migrate

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apiserver/pkg/storage/value"
)

// getsPerTxn is how many objects one read of changed objects asks for (one etcd
// transaction of gets, below etcd's default --max-txn-ops of 128).
const getsPerTxn = 64

// rescanChanged is the verifying re-scan of a resource the migration wrote to (see
// ledger.go): it reads every key with its ModRevision at one revision, keys only, and
// the values of the objects that are not as a transaction of the migration left them;
// the others are counted from the ledger, so that every count and byte total is what a
// whole re-scan would find.
func rescanChanged(ctx context.Context, opts InventoryOptions, res Resource, tr value.Transformer, t *tally, ours carried) (*ResourceInventory, error) {
	keys := newPager(opts.Client, res, "", opts.PageSize, true)
	keys.keysOnly = true
	keys.rev = opts.Revision
	var results []checkResult
	err := readPages(ctx, opts, keys, func(page []*mvccpb.KeyValue) error {
		var changed [][]byte
		for _, kv := range page {
			if b, size, ok := ours.lookup(kv.Key, kv.ModRevision); ok {
				t.addCarried(kv.Key, b, size)
				continue
			}
			changed = append(changed, kv.Key)
		}
		kvs, err := readChanged(ctx, opts, keys.rev, page, changed, ours)
		if err != nil {
			return err
		}
		if len(kvs) != len(changed) {
			return fmt.Errorf("reading the %d changed objects of a page under %s at etcd revision %d: etcd answered %d", len(changed), res.KeyPrefix, keys.rev, len(kvs))
		}
		results, err = tallyValues(ctx, opts, tr, t, kvs, results)
		return err
	})
	if err != nil {
		return nil, err
	}
	return t.inventory(keys.rev), nil
}

// readChanged returns, with their values at rev, the objects of page (read keys only at
// rev) whose keys are changed: the whole span of the page in one range request when
// they are most of it (at one revision it holds exactly the page's keys), else those
// objects alone.
func readChanged(ctx context.Context, opts InventoryOptions, rev int64, page []*mvccpb.KeyValue, changed [][]byte, ours carried) ([]*mvccpb.KeyValue, error) {
	if len(changed) == 0 {
		return nil, nil
	}
	if 2*len(changed) <= len(page) {
		return readKeysAt(ctx, opts.Client, rev, changed)
	}
	first, last := string(page[0].Key), string(page[len(page)-1].Key)
	resp, err := opts.Client.Get(ctx, first, clientv3.WithRange(last+"\x00"), clientv3.WithRev(rev), clientv3.WithLimit(int64(len(page))))
	if status.Code(err) == codes.ResourceExhausted {
		// Larger values than the client accepts in one answer: one by one, in
		// transactions that halve until they fit.
		return readKeysAt(ctx, opts.Client, rev, changed)
	}
	if errors.Is(err, rpctypes.ErrCompacted) {
		return nil, errCompacted
	}
	if err != nil {
		return nil, fmt.Errorf("reading etcd keys from %q to %q at revision %d: %w", first, last, rev, err)
	}
	out := make([]*mvccpb.KeyValue, 0, len(changed))
	for _, kv := range resp.Kvs {
		if _, _, ok := ours.lookup(kv.Key, kv.ModRevision); !ok {
			out = append(out, kv)
		}
	}
	return out, nil
}

// readKeysAt reads keys at rev, getsPerTxn of them per etcd transaction (fewer when
// the answer is larger than the client accepts).
func readKeysAt(ctx context.Context, kv clientv3.KV, rev int64, keys [][]byte) ([]*mvccpb.KeyValue, error) {
	var out []*mvccpb.KeyValue
	per := getsPerTxn
	for len(keys) > 0 {
		n := min(per, len(keys))
		ops := make([]clientv3.Op, n)
		for i, k := range keys[:n] {
			ops[i] = clientv3.OpGet(string(k), clientv3.WithRev(rev))
		}
		resp, err := kv.Txn(ctx).Then(ops...).Commit()
		if status.Code(err) == codes.ResourceExhausted && n > 1 {
			per = n / 2
			continue
		}
		if errors.Is(err, rpctypes.ErrCompacted) {
			return nil, errCompacted
		}
		if err != nil {
			return nil, fmt.Errorf("reading %d etcd keys from %q at revision %d: %w", n, keys[0], rev, err)
		}
		for _, r := range resp.Responses {
			out = append(out, r.GetResponseRange().GetKvs()...)
		}
		keys = keys[n:]
	}
	return out, nil
}
