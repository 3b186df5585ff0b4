package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/big"
	"strings"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"go.etcd.io/etcd/api/v3/v3rpc/rpctypes"
	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// A page of a scan stops at DefaultPageSize objects or about DefaultPageBytes,
// whichever comes first.
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
const firstPageLimit = 16

// windowKeys is how many keys, in pages of the count being asked for, a bounded window
// is sized to hold. etcd answers every range request with the count of all the keys
// from its start to its end, walking its in-memory index to find it, whatever the
// limit; a page read up to the end of the resource therefore costs as much as the rest
// of the resource, and a scan of N keys N²/page. Each request after the first is
// bounded instead to a window of about windowKeys pages, guessed from the keys counted
// in the window before. Counting a key is much cheaper than a round trip, so the window
// is sized generously: a window holding fewer keys than the page costs another request.
const windowKeys = 4

// pager walks one resource's key range page by page. With pinned set, every page is
// read at the revision of the first page (a consistent snapshot); otherwise each page
// is read at the latest revision.
//
// A page holds the first keys from where the last one stopped, as many as its count
// asks (fewer only at the end of the range). It may take more than one request: each
// request reads a window [next, stop) of the range, and a page continues into the next
// window when its window held too few.
type pager struct {
	kv       clientv3.KV
	prefix   string
	end      string
	next     string
	pageSize int64
	maxBytes int64
	limit    int64 // count of the next page
	largest  int64 // largest key+value seen in this scan
	pinned   bool
	keysOnly bool
	rev      int64
	done     bool
	// The densities of keys last seen; none means unknown, and the next request then
	// reads up to the end of the range.
	densities []density
	empties   int // windows found empty since the densities were seen
	// The end of the window last read and how many of its keys are still ahead of
	// p.next (counted at that request's revision).
	knownStop string
	knownKeys int64
}

// density says that keys keys lie in [from, to).
type density struct {
	from, to string
	keys     int64
}

func newPager(kv clientv3.KV, res Resource, from string, pageSize int64, pinned bool) *pager {
	if pageSize <= 0 {
		pageSize = DefaultPageSize
	}
	start := res.KeyPrefix
	if from != "" {
		start = from
	}
	return &pager{kv: kv, prefix: res.KeyPrefix, end: clientv3.GetPrefixRangeEnd(res.KeyPrefix), next: start, pageSize: pageSize,
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
	var kvs []*mvccpb.KeyValue
	for !p.done && int64(len(kvs)) < p.limit {
		more, err := p.read(ctx, p.limit-int64(len(kvs)))
		if err != nil {
			return nil, err
		}
		kvs = append(kvs, more...)
	}
	for _, kv := range kvs {
		p.largest = max(p.largest, int64(len(kv.Key)+len(kv.Value)))
	}
	p.limit = min(p.pageSize, 2*p.limit, max(1, p.maxBytes/max(p.largest, 1)))
	return kvs, nil
}

// read asks for up to want keys of the window from p.next and moves p.next past them.
func (p *pager) read(ctx context.Context, want int64) ([]*mvccpb.KeyValue, error) {
	stop := p.windowEnd(want)
	var resp *clientv3.GetResponse
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(stop), clientv3.WithLimit(want)}
		if p.pinned && p.rev != 0 {
			opts = append(opts, clientv3.WithRev(p.rev))
		}
		if p.keysOnly {
			opts = append(opts, clientv3.WithKeysOnly())
		}
		var err error
		resp, err = p.kv.Get(ctx, p.next, opts...)
		if status.Code(err) == codes.ResourceExhausted {
			if want > 1 {
				// Never ask for that many again in this scan.
				want /= 2
				p.pageSize = want
				p.limit = min(p.limit, want)
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
	if p.rev == 0 || !p.pinned {
		p.rev = resp.Header.Revision
	}
	n := int64(len(resp.Kvs))
	// The count is of the whole window; a server or proxy that leaves it out still
	// returned n keys, and one more when it says there are more.
	counted := max(resp.Count, n)
	if resp.More {
		counted = max(counted, n+1)
	}
	if n == 0 {
		// A gap between the keys: the next window is wider.
		p.empties++
	} else {
		// Two guesses, and the next window takes the narrower: the keys returned are
		// the nearest to those that follow, but a few of them can sit closer together
		// than the rest; the window's count covers more keys, but they can be bunched
		// at its start, before a gap (a window that reaches the end of the range
		// counts the whole rest of it, which tells little when the keys share more
		// than the resource's prefix: a namespace, a name's stem). Both start at the
		// first key: a gap before it says nothing of the keys after it.
		p.densities, p.empties = p.densities[:0], 0
		if n > 1 {
			p.densities = append(p.densities, density{from: string(resp.Kvs[0].Key), to: string(resp.Kvs[n-1].Key), keys: n - 1})
		}
		if stop != p.end {
			p.densities = append(p.densities, density{from: string(resp.Kvs[0].Key), to: stop, keys: counted})
		}
	}
	p.knownStop, p.knownKeys = stop, counted-n
	switch {
	case resp.More && n > 0:
		p.next = string(resp.Kvs[n-1].Key) + "\x00"
	case stop == p.end:
		p.done = true
	default:
		// The window held fewer keys than asked for, and all of them were returned.
		p.next = stop
	}
	return resp.Kvs, nil
}

// emptyWindowGrowth is how much wider a window is than the last one, when that one was
// empty: a gap between the keys is crossed in a few requests, cheap since they count
// nothing, and the window that first reaches the keys after it is at most this many
// times wider than it had to be.
const emptyWindowGrowth = 16

// windowEnd returns the end of the next request's window, for a request of want keys:
// the end of the last window while it still holds enough keys but not many more than
// that, or else a key about windowKeys pages past p.next at the density of keys last
// seen; the end of the range when nothing is known yet or when the guess falls past the
// end.
//
// Keys are placed on a line by reading the bytes after the resource's prefix as a
// base-256 number of a fixed width (one byte longer than any key involved, so that the
// window's end is always past p.next).
func (p *pager) windowEnd(want int64) string {
	if p.knownStop != p.end && p.knownKeys >= want && p.knownKeys <= windowKeys*want {
		// Counting the rest of a window much larger than the page, page after page,
		// would cost as much as counting the rest of the range does.
		return p.knownStop
	}
	if len(p.densities) == 0 || !strings.HasPrefix(p.next, p.prefix) {
		return p.end
	}
	width := len(p.next)
	for _, d := range p.densities {
		width = max(width, len(d.from), len(d.to))
	}
	width += 1 - len(p.prefix)
	top := new(big.Int).Lsh(big.NewInt(1), uint(8*width))
	at := func(key string) *big.Int {
		if key == p.end || !strings.HasPrefix(key, p.prefix) {
			return top
		}
		b := make([]byte, width)
		copy(b, key[len(p.prefix):])
		return new(big.Int).SetBytes(b)
	}
	// span = (to - from) * windowKeys * limit / keys * growth^empties, the narrowest,
	// at least 1.
	var span *big.Int
	for _, d := range p.densities {
		s := new(big.Int).Sub(at(d.to), at(d.from))
		s.Mul(s, big.NewInt(windowKeys*p.limit))
		s.Quo(s, big.NewInt(d.keys))
		if span == nil || s.Cmp(span) < 0 {
			span = s
		}
	}
	if span.Sign() <= 0 {
		span.SetInt64(1)
	}
	for range p.empties {
		span.Mul(span, big.NewInt(emptyWindowGrowth))
	}
	stop := span.Add(span, at(p.next))
	if stop.Cmp(top) >= 0 {
		return p.end
	}
	suffix := stop.FillBytes(make([]byte, width))
	// Trailing zero bytes only lengthen the keys of the next estimate; drop them while
	// the end stays past p.next.
	key := p.prefix + string(suffix)
	if trimmed := p.prefix + string(bytes.TrimRight(suffix, "\x00")); trimmed > p.next {
		key = trimmed
	}
	return key
}

var errCompacted = errors.New("the etcd revision of the scan was compacted while the scan ran")

// countKeys returns how many keys a resource has (one cheap count-only request), with
// the header etcd answered it with.
func countKeys(ctx context.Context, kv clientv3.KV, res Resource) (int64, *etcdserverpb.ResponseHeader, error) {
	resp, err := kv.Get(ctx, res.KeyPrefix, clientv3.WithRange(clientv3.GetPrefixRangeEnd(res.KeyPrefix)), clientv3.WithCountOnly())
	if err != nil {
		return 0, nil, fmt.Errorf("counting etcd keys under %q: %w", res.KeyPrefix, err)
	}
	return resp.Count, resp.Header, nil
}
