package migrate

import (
	"context"
	"errors"
	"fmt"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
)

// DefaultPageSize is how many objects one etcd range request returns. Memory use of a
// scan is bounded by one page (two while the next page is prefetched).
const DefaultPageSize = 500

// pager walks one resource's key range page by page. With pinned set, every page is
// read at the revision of the first page (a consistent snapshot); otherwise each page
// is read at the latest revision.
type pager struct {
	kv       clientv3.KV
	end      string
	next     string
	pageSize int64
	pinned   bool
	rev      int64
	done     bool
}

func newPager(kv clientv3.KV, res Resource, from string, pageSize int64, pinned bool) *pager {
	if pageSize <= 0 {
		pageSize = DefaultPageSize
	}
	start := res.KeyPrefix
	if from != "" {
		start = from
	}
	return &pager{kv: kv, end: clientv3.GetPrefixRangeEnd(res.KeyPrefix), next: start, pageSize: pageSize, pinned: pinned}
}

// page returns the next page, or nil once the range is exhausted. A compacted pinned
// revision is reported as errCompacted; an unpinned pager cannot see one.
func (p *pager) page(ctx context.Context) ([]*mvccpb.KeyValue, error) {
	if p.done {
		return nil, nil
	}
	opts := []clientv3.OpOption{clientv3.WithRange(p.end), clientv3.WithLimit(p.pageSize)}
	if p.pinned && p.rev != 0 {
		opts = append(opts, clientv3.WithRev(p.rev))
	}
	resp, err := p.kv.Get(ctx, p.next, opts...)
	if err != nil {
		if errors.Is(err, rpctypes.ErrCompacted) {
			return nil, errCompacted
		}
		return nil, fmt.Errorf("reading etcd keys from %q: %w", p.next, err)
	}
	if p.rev == 0 || !p.pinned {
		p.rev = resp.Header.Revision
	}
	if !resp.More || len(resp.Kvs) == 0 {
		p.done = true
	}
	if n := len(resp.Kvs); n > 0 {
		p.next = string(resp.Kvs[n-1].Key) + "\x00"
	}
	return resp.Kvs, nil
}

var errCompacted = errors.New("the etcd revision of the scan was compacted while the scan ran")

// countKeys returns how many keys a resource has (one cheap count-only request).
func countKeys(ctx context.Context, kv clientv3.KV, res Resource) (int64, error) {
	resp, err := kv.Get(ctx, res.KeyPrefix, clientv3.WithRange(clientv3.GetPrefixRangeEnd(res.KeyPrefix)), clientv3.WithCountOnly())
	if err != nil {
		return 0, fmt.Errorf("counting etcd keys under %q: %w", res.KeyPrefix, err)
	}
	return resp.Count, nil
}
