package migrate

import (
	"context"
	"fmt"
	"slices"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
)

// countingKV adds up what etcd walked to answer each range request: the count it
// returns is of every key from the request's start to its end, found by visiting each
// of them in its index, whatever the limit.
type countingKV struct {
	clientv3.KV
	requests int
	counted  int64
}

func (k *countingKV) Get(ctx context.Context, key string, opts ...clientv3.OpOption) (*clientv3.GetResponse, error) {
	resp, err := k.KV.Get(ctx, key, opts...)
	if err == nil {
		k.requests++
		k.counted += resp.Count
	}
	return resp, err
}

// scanKeys plants keys spread unevenly under the secrets prefix: a large namespace, many
// small ones, long names, bytes above ASCII and a lone key at the far end, with the
// gaps between them that a window has to cross.
func scanKeys(t *testing.T, cli *clientv3.Client, res Resource) []string {
	t.Helper()
	var keys []string
	for i := range 3000 {
		keys = append(keys, fmt.Sprintf("%sbig/obj-%05d", res.KeyPrefix, i))
	}
	for ns := range 50 {
		for i := range 20 {
			keys = append(keys, fmt.Sprintf("%sns-%02d/%c-%d", res.KeyPrefix, ns, 'a'+i%26, i*7919))
		}
	}
	for i := range 500 {
		keys = append(keys, fmt.Sprintf("%slong/%s-%04d", res.KeyPrefix, strings.Repeat("x", 100), i))
	}
	for i := range 200 {
		keys = append(keys, fmt.Sprintf("%szz/\xff\xfe-%d", res.KeyPrefix, i))
	}
	keys = append(keys, res.KeyPrefix+"\xff\xff\xff\xff")
	ctx := context.Background()
	for batch := range slices.Chunk(keys, 100) {
		var ops []clientv3.Op
		for _, k := range batch {
			ops = append(ops, clientv3.OpPut(k, "v"))
		}
		if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
	}
	slices.Sort(keys)
	return keys
}

// TestScanCountsEachKeyAFewTimes: etcd counts every key from a range request's start to
// its end, so a scan whose every page read up to the end of the resource walked N²/page
// keys (about 25 N here, 165 N for 160,000 keys in pages of 500); bounded windows
// keep it to a few times N. The pages stay what
// they were: each holds as many keys as its count asks, the keys in order, each once.
func TestScanCountsEachKeyAFewTimes(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	res := ResourceFor(DefaultEtcdPrefix, secrets)
	keys := scanKeys(t, cli, res)
	n := int64(len(keys))

	for _, tc := range []struct {
		name   string
		pinned bool
		from   string
	}{{"pinned", true, ""}, {"latest", false, ""}, {"resumed", false, keys[1234] + "\x00"}} {
		t.Run(tc.name, func(t *testing.T) {
			kv := &countingKV{KV: cli}
			p := newPager(kv, res, tc.from, 100, tc.pinned)
			var seen []string
			pages := 0
			for {
				want := p.limit
				kvs, err := p.page(ctx)
				if err != nil {
					t.Fatal(err)
				}
				if len(kvs) == 0 {
					break
				}
				pages++
				if int64(len(kvs)) != want && !p.done {
					t.Fatalf("page %d holds %d keys, asked for %d, and the range goes on", pages, len(kvs), want)
				}
				for _, kv := range kvs {
					seen = append(seen, string(kv.Key))
				}
			}
			expected := keys
			if tc.from != "" {
				expected = keys[1235:]
			}
			if !slices.Equal(seen, expected) {
				t.Fatalf("the scan saw %d keys, want the %d planted, in order, each once", len(seen), len(expected))
			}
			t.Logf("%d keys in %d pages: %d requests, %d keys counted (%.1f per key)", len(seen), pages, kv.requests, kv.counted, float64(kv.counted)/float64(n))
			if kv.counted > 8*n {
				t.Errorf("etcd counted %d keys to answer a scan of %d: each page counts the rest of the range", kv.counted, n)
			}
			// Crossing a gap between keys takes a few requests that find nothing (cheap:
			// they count nothing); a window of one key each would take thousands.
			if kv.requests > 10*pages {
				t.Errorf("%d requests for %d pages: the windows are too narrow", kv.requests, pages)
			}
		})
	}
}

// TestPinnedScanIgnoresLaterWrites: a pinned scan reads every window at the revision of
// its first page, so keys written or deleted after it started, ahead of the scan or
// behind it, change nothing in what it returns.
func TestPinnedScanIgnoresLaterWrites(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	res := ResourceFor(DefaultEtcdPrefix, secrets)
	keys := scanKeys(t, cli, res)
	p := newPager(cli, res, "", 100, true)
	var seen []string
	for {
		kvs, err := p.page(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if len(kvs) == 0 {
			break
		}
		for _, kv := range kvs {
			seen = append(seen, string(kv.Key))
		}
		if len(seen) == 100 {
			if _, err := cli.Delete(ctx, keys[2000]); err != nil {
				t.Fatal(err)
			}
			for _, k := range []string{keys[50] + "-new", keys[3000] + "-new", res.KeyPrefix + "big/obj-99999"} {
				if _, err := cli.Put(ctx, k, "v"); err != nil {
					t.Fatal(err)
				}
			}
		}
	}
	if !slices.Equal(seen, keys) {
		t.Fatalf("the pinned scan saw %d keys, want the %d there when it started", len(seen), len(keys))
	}
}
