package migrate

import (
	"context"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"google.golang.org/grpc"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// heapSampler records the peak heap (live and not yet collected) above a baseline while
// a benchmark runs.
type heapSampler struct {
	base uint64
	peak atomic.Uint64
	stop chan struct{}
	wg   sync.WaitGroup
}

func startHeapSampler() *heapSampler {
	runtime.GC()
	var ms runtime.MemStats
	runtime.ReadMemStats(&ms)
	h := &heapSampler{base: ms.HeapAlloc, stop: make(chan struct{})}
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-h.stop:
				return
			case <-t.C:
				var ms runtime.MemStats
				runtime.ReadMemStats(&ms)
				if ms.HeapAlloc > h.peak.Load() {
					h.peak.Store(ms.HeapAlloc)
				}
			}
		}
	}()
	return h
}

// peakMB stops sampling and returns the peak heap growth in MiB.
func (h *heapSampler) peakMB() float64 {
	close(h.stop)
	h.wg.Wait()
	p := h.peak.Load()
	if p < h.base {
		return 0
	}
	return float64(p-h.base) / (1 << 20)
}

// benchEtcd starts an embedded etcd, or uses the etcd at $REKEY_BENCH_ETCD (e.g. an
// etcd process from hack/tools/etcd), whose /registry/ range it clears first. With an
// external etcd the heap figures are the migration's and inventory's own; with the
// embedded one they include the etcd server's heap.
func benchEtcd(b *testing.B) *clientv3.Client {
	if ep := os.Getenv("REKEY_BENCH_ETCD"); ep != "" {
		cli, err := clientv3.New(clientv3.Config{Endpoints: []string{ep}, DialTimeout: 5 * time.Second, Logger: zap.NewNop(),
			DialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64 << 20))}})
		if err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { _ = cli.Close() })
		if _, err := cli.Delete(context.Background(), "/registry/", clientv3.WithPrefix()); err != nil {
			b.Fatal(err)
		}
		return cli
	}
	srv := etcdtest.StartWith(b, etcdtest.Options{QuotaBackendBytes: 8 << 30})
	return srv.Client(b)
}

// BenchmarkMigrateLocal re-encrypts 10,000 objects (secrets, ~250 B of plaintext)
// from one aesgcm key to another per iteration, including the verifying re-scan.
func BenchmarkMigrateLocal(b *testing.B) {
	const n = 10000
	cli := benchEtcd(b)
	_, s0 := setFor(b, "secrets", "aesgcm:k0")
	writeObjects(b, cli, s0, secrets, n)
	benchMigrate(b, cli, n, alternateLocalKeys(b))
}

// alternateLocalKeys is the target of each iteration of a local-key migration
// benchmark whose objects are stored under k0: k1 first, then k0 again, and so on.
func alternateLocalKeys(b *testing.B) func(i int) *transformers.Set {
	targets := []*transformers.Set{
		mustSet(b, mustConfig(b, configYAML("secrets", "aesgcm:k1,k0"))),
		mustSet(b, mustConfig(b, configYAML("secrets", "aesgcm:k0,k1"))),
	}
	return func(i int) *transformers.Set { return targets[i%2] }
}

// BenchmarkMigrateKMSv2 re-encrypts 10,000 KMS v2 objects per iteration after the
// plugin's key id changed (reads decrypt the old DEK seed through the plugin once, writes
// use the new one).
func BenchmarkMigrateKMSv2(b *testing.B) {
	const n = 10000
	cli := benchEtcd(b)
	kms := startKMS(b, "kek-0")
	set := buildReady(b, configYAML("secrets")+kms.ProviderYAML("plug"), kms.Factory)
	writeObjects(b, cli, set, secrets, n)
	gen := 0
	benchMigrate(b, cli, n, func(int) *transformers.Set {
		gen++
		old := set.KMSProviders()[0].Status().KeyIDHash
		kms.SetKeys(b, fmt.Sprintf("kek-%d", gen), fmt.Sprintf("kek-%d", gen-1))
		for set.KMSProviders()[0].Status().KeyIDHash == old {
			time.Sleep(20 * time.Millisecond)
		}
		return set
	})
}

// BenchmarkMigrateLocalSized is BenchmarkMigrateLocal with Secrets of 1–10 KiB (as
// the scale scenario's): what a migration allocates grows with the values it copies,
// and in an apiserver every byte of it brings the next garbage collection of a heap
// that holds the watch cache closer.
func BenchmarkMigrateLocalSized(b *testing.B) {
	const n = 5000
	cli := benchEtcd(b)
	_, s0 := setFor(b, "secrets", "aesgcm:k0")
	writeSizedSecrets(b, cli, s0, testResources()[0], n)
	benchMigrate(b, cli, n, alternateLocalKeys(b))
}

// writeSizedSecrets stores n Secrets of 1–10 KiB of plaintext under res, written with
// set's write key.
func writeSizedSecrets(b *testing.B, cli *clientv3.Client, set *transformers.Set, res Resource, n int) {
	ctx := context.Background()
	tr := set.TransformerFor(secrets)
	var ops []clientv3.Op
	for i := range n {
		key := fmt.Sprintf("%sns%d/obj-%06d", res.KeyPrefix, i%10, i)
		plain := storedObject(fmt.Sprintf("{key=%s pad=%s}", key, strings.Repeat("x", 1024+(i*7919)%(9*1024))))
		stored, err := tr.TransformToStorage(ctx, plain, value.DefaultContext(key))
		if err != nil {
			b.Fatal(err)
		}
		ops = append(ops, clientv3.OpPut(key, string(stored)))
		if len(ops) == 64 || i == n-1 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				b.Fatal(err)
			}
			ops = ops[:0]
		}
	}
}

func benchMigrate(b *testing.B, cli *clientv3.Client, n int, next func(i int) *transformers.Set) {
	b.ReportAllocs()
	var elapsed time.Duration
	var peak float64
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		b.StopTimer()
		set := next(i)
		h := startHeapSampler()
		b.StartTimer()
		start := time.Now()
		res, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(set), Resources: testResources()[:1]})
		elapsed += time.Since(start)
		b.StopTimer()
		peak = max(peak, h.peakMB())
		if err != nil {
			b.Fatal(err)
		}
		if res.Rewritten != int64(n) {
			b.Fatalf("rewritten %d, want %d", res.Rewritten, n)
		}
		b.StartTimer()
	}
	b.ReportMetric(float64(n*b.N)/elapsed.Seconds(), "objects/s")
	b.ReportMetric(peak, "peak-heap-MiB")
}

// BenchmarkInventory takes an inventory (no decrypt) of 10,000 and then 100,000
// objects; the peak heap growth must not grow with the object count.
func BenchmarkInventory(b *testing.B) {
	cli := benchEtcd(b)
	_, set := setFor(b, "secrets", "aesgcm:k1,k0")
	_, old := setFor(b, "secrets", "aesgcm:k0")
	written := 0
	for _, n := range []int{10000, 100000} {
		// writeObjects numbers objects from 0; write the extra ones under another
		// namespace prefix by writing all n again (puts of existing keys are updates).
		if n > written {
			writeObjects(b, cli, old, secrets, n)
			written = n
		}
		b.Run(fmt.Sprintf("objects=%d", n), func(b *testing.B) {
			var peak float64
			var elapsed time.Duration
			for i := 0; i < b.N; i++ {
				h := startHeapSampler()
				start := time.Now()
				inv, err := TakeInventory(context.Background(), InventoryOptions{Client: cli, Source: FromSet(set), Resources: testResources()[:1], PageSize: 1000})
				elapsed += time.Since(start)
				peak = max(peak, h.peakMB())
				if err != nil {
					b.Fatal(err)
				}
				if inv.Find("secrets").Objects != int64(n) {
					b.Fatalf("counted %d objects, want %d", inv.Find("secrets").Objects, n)
				}
			}
			b.ReportMetric(elapsed.Seconds()/float64(b.N), "s/inventory")
			b.ReportMetric(float64(n*b.N)/elapsed.Seconds(), "objects/s")
			b.ReportMetric(peak, "peak-heap-MiB")
		})
	}
}

// BenchmarkVerifyingRescan is a migration's verifying re-scan of 20,000 Secrets of
// 1–10 KiB just written under the write key, in two ways side by side: reading every
// value and decrypting it (whole), and reading keys only, counting what the migration
// wrote from its ledger (changed-only; here nothing changed since, so it reads no
// value). The ledger is the one the migration's transactions would have recorded: one
// entry per stored object at its ModRevision.
func BenchmarkVerifyingRescan(b *testing.B) {
	const n = 20000
	ctx := context.Background()
	cli := benchEtcd(b)
	_, set := setFor(b, "secrets", "aesgcm:k1,k0")
	res := testResources()[0]
	writeSizedSecrets(b, cli, set, res, n)
	src := FromSet(set)
	ledger := newWriteLedger()
	ledger.begin(res.String(), newClassifier(src.Rule(secrets), src.KnownPrefixes()))
	byRev := map[int64][]rewrite{}
	for kvs := range scanAll(b, cli, res) {
		for _, kv := range kvs {
			byRev[kv.ModRevision] = append(byRev[kv.ModRevision], rewrite{key: kv.Key, val: kv.Value, readBack: true})
		}
	}
	head, err := cli.Get(ctx, res.KeyPrefix, clientv3.WithCountOnly(), clientv3.WithPrefix())
	if err != nil {
		b.Fatal(err)
	}
	for rev, batch := range byRev {
		ledger.record(res.String(), head.Header.ClusterId, rev, batch)
	}
	for _, c := range []struct {
		name   string
		ledger *writeLedger
	}{{"whole", nil}, {"changed-only", ledger}} {
		b.Run(c.name, func(b *testing.B) {
			var elapsed time.Duration
			for i := 0; i < b.N; i++ {
				start := time.Now()
				inv, err := TakeInventory(ctx, InventoryOptions{Client: cli, Source: src, Resources: []Resource{res}, DecryptCheck: true, ledger: c.ledger})
				elapsed += time.Since(start)
				if err != nil {
					b.Fatal(err)
				}
				if ri := inv.Find("secrets"); ri.Objects != n || ri.Stale != 0 {
					b.Fatalf("counted %d objects, %d stale; want %d, 0", ri.Objects, ri.Stale, n)
				}
			}
			b.ReportMetric(float64(n*b.N)/elapsed.Seconds(), "objects/s")
		})
	}
}

// scanAll yields res's objects page by page at the latest revision.
func scanAll(b *testing.B, cli *clientv3.Client, res Resource) func(func([]*mvccpb.KeyValue) bool) {
	return func(yield func([]*mvccpb.KeyValue) bool) {
		p := newPager(cli, res, "", 0, true)
		for {
			kvs, err := p.page(context.Background())
			if err != nil {
				b.Fatal(err)
			}
			if len(kvs) == 0 || !yield(kvs) {
				return
			}
		}
	}
}
