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
)

// Page bounds of a scan. A page stops at DefaultPageSize objects or about
// DefaultPageBytes, whichever comes first.
//
// etcd's range request has a count limit but no byte limit, and keys-only answers carry
// no value sizes, so the byte bound is kept by choosing each page's count: a scan starts
// at firstPageLimit objects, at most doubles the count from page to page, and never asks
// for more than DefaultPageBytes divided by the largest key+value seen so far in the
// scan. A page can therefore exceed the byte bound only when it holds values larger
// than every value before it (by at most that ratio; etcd itself caps values at its
// --max-request-bytes, 1.5 MiB by default). An answer larger than the etcd client's
// receive limit (gRPC ResourceExhausted) is asked again with half the count, which
// then caps the count for the rest of the scan.
const (
	DefaultPageSize  = 500
	DefaultPageBytes = 8 << 20
	firstPageLimit   = 16
)

// pager walks one resource's key range page by page. With pinned set, every page is
// read at the revision of the first page (a consistent snapshot); otherwise each page
// is read at the latest revision.
type pager struct {
	kv       clientv3.KV
	end      string
	next     string
	pageSize int64
	maxBytes int64
	limit    int64 // count of the next request
	largest  int64 // largest key+value seen in this scan
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
	return &pager{kv: kv, end: clientv3.GetPrefixRangeEnd(res.KeyPrefix), next: start, pageSize: pageSize,
		maxBytes: DefaultPageBytes, limit: min(pageSize, firstPageLimit), pinned: pinned}
}

// withPageBytes sets the byte bound of a page (DefaultPageBytes when n <= 0).
func (p *pager) withPageBytes(n int64) *pager {
	if n > 0 {
		p.maxBytes = n
	}
	return p
}

// page returns the next page, or nil once the range is exhausted. A compacted pinned
// revision is reported as errCompacted; an unpinned pager cannot see one.
func (p *pager) page(ctx context.Context) ([]*mvccpb.KeyValue, error) {
	if p.done {
		return nil, nil
	}
	var resp *clientv3.GetResponse
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(p.end), clientv3.WithLimit(p.limit)}
		if p.pinned && p.rev != 0 {
			opts = append(opts, clientv3.WithRev(p.rev))
		}
		var err error
		resp, err = p.kv.Get(ctx, p.next, opts...)
		if status.Code(err) == codes.ResourceExhausted {
			if p.limit > 1 {
				// Never ask for that many again in this scan.
				p.limit /= 2
				p.pageSize = p.limit
				continue
			}
			return nil, fmt.Errorf("reading etcd key %q: one value is larger than the etcd client accepts (%w); raise the client's receive limit", p.next, err)
		}
		if err != nil {
			if errors.Is(err, rpctypes.ErrCompacted) {
				return nil, errCompacted
			}
			return nil, fmt.Errorf("reading etcd keys from %q: %w", p.next, err)
		}
		break
	}
	for _, kv := range resp.Kvs {
		p.largest = max(p.largest, int64(len(kv.Key)+len(kv.Value)))
	}
	p.limit = min(p.pageSize, 2*p.limit, max(1, p.maxBytes/max(p.largest, 1)))
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
