package bench

import (
	"context"
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The scale scenario's testbed, the same for both sides: an etcd process with
// kube-apiserver's usual 2 GiB quota, N Secrets written straight into it in the stored
// format, one shim running the side's layer, a client workload through the shim and a
// poller of etcd's database size and alarms.

const (
	// defaultScaleQuota is etcd's --quota-backend-bytes: 2 GiB, the size kube clusters
	// run with (and etcd's default).
	defaultScaleQuota = 2 << 30
	// scalePrefix is the shim's --etcd-prefix (kube-apiserver's default).
	scalePrefix = "/registry"
	// scaleClientNamespace holds the client workload's Secrets, apart from the N.
	scaleClientNamespace = "scale-client"
	// scaleNamespaces spreads the N Secrets over this many namespaces.
	scaleNamespaces = 100
	// Seeding batches: etcd's default --max-txn-ops is 128 and --max-request-bytes
	// 1.5 MiB, so a transaction holds at most 128 puts and about 1 MiB.
	seedBatchOps   = 128
	seedBatchBytes = 1 << 20
	seedWorkers    = 8
)

// scaleDataSize is the size of Secret i's data, 1–10 KiB skewed to small values: 90%
// uniform in 1–1.25 KiB, 9% in 1.25–4 KiB, 1% in 4–10 KiB (mean about 1.32 KiB). Even
// so a million of them do not fit etcd's 2 GiB quota: once stored (encrypted, with the
// key, the object's metadata and bbolt's pages) a Secret takes about 2.2 KiB of
// database, and twice that while a rewrite's old revisions wait for compaction; a
// million run with -scale-quota-bytes 8 GiB. It depends only on i, so every side stores
// the same data.
func scaleDataSize(i int) int {
	h := fnv.New64a()
	var b [8]byte
	binary.LittleEndian.PutUint64(b[:], uint64(i))
	h.Write(b[:])
	r := rand.New(rand.NewPCG(h.Sum64(), 0x5ca1e))
	switch p := r.IntN(1000); {
	case p < 900:
		return 1024 + r.IntN(256+1)
	case p < 990:
		return 1280 + r.IntN(4096-1280+1)
	default:
		return 4096 + r.IntN(10240-4096+1)
	}
}

// scaleSecretKey is the etcd key of Secret i of the N.
func scaleSecretKey(i int) (key, ns, name string) {
	ns = fmt.Sprintf("scale-%02d", i%scaleNamespaces)
	name = fmt.Sprintf("s-%07d", i)
	return scalePrefix + "/secrets/" + ns + "/" + name, ns, name
}

// scaleTransformers builds rekey's transformers for an encryption config, as the
// apiserver builds them (local keys only).
func scaleTransformers(ctx context.Context, content []byte) (*transformers.Set, error) {
	cfg, err := config.Parse(content, "scale", config.Options{})
	if err != nil {
		return nil, err
	}
	return transformers.Build(ctx, cfg, transformers.Options{})
}

// seedSecrets writes n Secrets straight into etcd as kube-apiserver stores them:
// protobuf in the k8s envelope, encrypted with t (the etcd key is the authenticated
// data), in transactions of up to seedBatchOps puts from seedWorkers goroutines.
func seedSecrets(ctx context.Context, cli *clientv3.Client, t value.Transformer, n int) (int64, error) {
	codec := testbed.NewStorageCodec()
	filler := make([]byte, 10240)
	for i := range filler {
		filler[i] = byte('a' + i%26)
	}
	created := metav1.NewTime(time.Now().UTC().Truncate(time.Second))
	var next atomic.Int64
	var stored atomic.Int64
	errs := make([]error, seedWorkers)
	var wg sync.WaitGroup
	for w := range seedWorkers {
		wg.Go(func() {
			var ops []clientv3.Op
			size := 0
			flush := func() error {
				if len(ops) == 0 {
					return nil
				}
				_, err := cli.Txn(ctx).Then(ops...).Commit()
				ops, size = ops[:0], 0
				return err
			}
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					errs[w] = flush()
					return
				}
				key, ns, name := scaleSecretKey(i)
				s := &corev1.Secret{
					ObjectMeta: metav1.ObjectMeta{Name: name, Namespace: ns, UID: types.UID(fmt.Sprintf("00000000-0000-4000-8000-%012d", i)), CreationTimestamp: created},
					Type:       corev1.SecretTypeOpaque,
					Data:       map[string][]byte{"data": filler[:scaleDataSize(i)]},
				}
				plain, err := codec.Encode(s)
				if err != nil {
					errs[w] = err
					return
				}
				sealed, err := t.TransformToStorage(ctx, plain, value.DefaultContext(key))
				if err != nil {
					errs[w] = err
					return
				}
				if len(ops) == seedBatchOps || size+len(sealed) > seedBatchBytes {
					if errs[w] = flush(); errs[w] != nil {
						return
					}
				}
				ops = append(ops, clientv3.OpPut(key, string(sealed)))
				size += len(key) + len(sealed)
				stored.Add(int64(len(sealed)))
			}
		})
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			return 0, fmt.Errorf("seeding Secrets into etcd: %w", err)
		}
	}
	return stored.Load(), nil
}

// scaleInventory takes a fresh inventory of the stored Secrets with pkg/migrate (the
// scan `rekey inventory` runs) and returns it with the time it took.
func scaleInventory(ctx context.Context, cli *clientv3.Client, set *transformers.Set) (*migrate.ResourceInventory, time.Duration, error) {
	res := migrate.ResourceFor(scalePrefix, secretsGR)
	start := time.Now()
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{res}})
	d := time.Since(start)
	if err != nil {
		return nil, 0, err
	}
	r := inv.Find("secrets")
	if r == nil {
		return nil, 0, fmt.Errorf("the inventory has no secrets")
	}
	return r, d, nil
}

// dbWatch polls etcd's Maintenance.Status and AlarmList every second.
type dbWatch struct {
	stop chan struct{}
	done chan struct{}
	// Written by the poller, read after stop.
	peakSize, peakInUse int64
	firstSize           int64 // DbSize at the first poll (right after seeding)
	noSpace             int   // alarms raised, the most seen at once
	errs                int
}

func watchDB(cli *clientv3.Client, endpoint string) *dbWatch {
	d := &dbWatch{stop: make(chan struct{}), done: make(chan struct{})}
	go func() {
		defer close(d.done)
		t := time.NewTicker(time.Second)
		defer t.Stop()
		for {
			d.poll(cli, endpoint)
			select {
			case <-d.stop:
				d.poll(cli, endpoint)
				return
			case <-t.C:
			}
		}
	}()
	return d
}

func (d *dbWatch) poll(cli *clientv3.Client, endpoint string) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	st, err := cli.Status(ctx, endpoint)
	if err != nil {
		d.errs++
		return
	}
	if d.firstSize == 0 {
		d.firstSize = st.DbSize
	}
	d.peakSize, d.peakInUse = max(d.peakSize, st.DbSize), max(d.peakInUse, st.DbSizeInUse)
	al, err := cli.AlarmList(ctx)
	if err != nil {
		d.errs++
		return
	}
	n := 0
	for _, a := range al.Alarms {
		if a.Alarm == etcdserverpb.AlarmType_NOSPACE {
			n++
		}
	}
	d.noSpace = max(d.noSpace, n)
}

// Stop ends the polling (after one last poll) and returns the figures.
func (d *dbWatch) Stop() *dbWatch {
	close(d.stop)
	<-d.done
	return d
}

// clientOp is one request of the client workload.
type clientOp struct {
	at      time.Time
	latency time.Duration
	failed  bool
}

// clientLoad is a steady workload through one apiserver: creates, updates and gets in
// turn at a fixed rate on its own namespace, every request's latency recorded. Each
// worker paces itself with a ticker; a request slower than the period delays the next
// (Go tickers drop ticks), so the offered rate falls when the apiserver slows, which the
// recorded latencies show.
type clientLoad struct {
	cancel context.CancelFunc
	wg     sync.WaitGroup
	mu     sync.Mutex
	ops    []clientOp
}

func startClientLoad(ctx context.Context, c kubernetes.Interface, rate float64, workers int) *clientLoad {
	ctx, cancel := context.WithCancel(ctx)
	l := &clientLoad{cancel: cancel}
	if rate <= 0 {
		return l
	}
	period := time.Duration(float64(time.Second) * float64(workers) / rate)
	secrets := c.CoreV1().Secrets(scaleClientNamespace)
	for w := range workers {
		l.wg.Go(func() {
			t := time.NewTicker(period)
			defer t.Stop()
			var names []string
			data := make([]byte, 1024)
			for i := 0; ; i++ {
				select {
				case <-ctx.Done():
					return
				case <-t.C:
				}
				start := time.Now()
				var err error
				switch {
				case i%3 == 0 || len(names) == 0:
					name := "c-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
					_, err = secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string][]byte{"data": data}}, metav1.CreateOptions{})
					if err == nil {
						names = append(names, name)
					}
				case i%3 == 1:
					var s *corev1.Secret
					if s, err = secrets.Get(ctx, names[len(names)-1], metav1.GetOptions{}); err == nil {
						s.Data["data"][0]++
						_, err = secrets.Update(ctx, s, metav1.UpdateOptions{})
					}
				default:
					_, err = secrets.Get(ctx, names[rand.IntN(len(names))], metav1.GetOptions{})
				}
				if ctx.Err() != nil {
					return
				}
				l.mu.Lock()
				l.ops = append(l.ops, clientOp{at: start, latency: time.Since(start), failed: err != nil && !apierrors.IsConflict(err)})
				l.mu.Unlock()
			}
		})
	}
	return l
}

// Stop ends the workload and returns every recorded request.
func (l *clientLoad) Stop() []clientOp {
	l.cancel()
	l.wg.Wait()
	return l.ops
}

// writeClientOps writes ops as CSV: start (Unix ms), latency (ms), failed; the first
// lines are comments with the baseline's start, the first edit and the migration's
// window, in Unix ms.
func writeClientOps(path string, ops []clientOp, baseStart, firstEdit, migStart, migEnd time.Time) error {
	var b strings.Builder
	for _, m := range []struct {
		name string
		at   time.Time
	}{{"baseline", baseStart}, {"first-edit", firstEdit}, {"migration-start", migStart}, {"migration-end", migEnd}} {
		fmt.Fprintf(&b, "# %s %d\n", m.name, m.at.UnixMilli())
	}
	b.WriteString("start_ms,latency_ms,failed\n")
	for _, o := range ops {
		fmt.Fprintf(&b, "%d,%.3f,%t\n", o.at.UnixMilli(), float64(o.latency)/float64(time.Millisecond), o.failed)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// clientWindow is the client latency of the requests started in [from, to).
type clientWindow struct {
	requests, failed int
	p50, p99         float64 // ms
}

func windowOf(ops []clientOp, from, to time.Time) clientWindow {
	var w clientWindow
	var ms []float64
	for _, o := range ops {
		if o.at.Before(from) || !o.at.Before(to) {
			continue
		}
		w.requests++
		if o.failed {
			w.failed++
			continue
		}
		ms = append(ms, float64(o.latency.Microseconds())/1000)
	}
	slices.Sort(ms)
	w.p50, w.p99 = percentile(ms, 50), percentile(ms, 99)
	return w
}

// scaleBed is one side's fresh testbed.
type scaleBed struct {
	etcd  *testbed.Etcd
	cli   *clientv3.Client
	fleet *testbed.Fleet
	key1  testbed.NamedKey
	// seedTime and storedBytes are the seeding's.
	seedTime    time.Duration
	storedBytes int64
}

// startScaleBed starts etcd with the quota, seeds n Secrets under key1 and starts one
// shim running layer on them.
func startScaleBed(ctx context.Context, dir string, bins testbed.Binaries, layer string, n int, quota int64, args []string) (b *scaleBed, err error) {
	if b, err = startScaleEtcd(ctx, dir, bins, n, quota); err != nil {
		return nil, err
	}
	b.fleet, err = testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: bins.Shim, Dir: filepath.Join(dir, "shim"), N: 1,
		EtcdServers: []string{b.etcd.Endpoint}, EtcdPrefix: scalePrefix,
		Layer: layer, Config: testbed.SecretsConfig(testbed.AESGCM(b.key1)).Render(), Args: args,
	})
	if err != nil {
		b.stop()
		return nil, err
	}
	return b, nil
}

// startScaleEtcd starts etcd with the quota and seeds n Secrets under key1: the bed
// without an apiserver.
func startScaleEtcd(ctx context.Context, dir string, bins testbed.Binaries, n int, quota int64) (*scaleBed, error) {
	// A local bed, not a named result: an error return must not leave the deferred
	// stop a nil bed (and etcd running).
	b := &scaleBed{key1: testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()}}
	var err error
	defer func() {
		if err != nil {
			b.stop()
		}
	}()
	if b.etcd, err = testbed.StartEtcdWith(ctx, bins.Etcd, filepath.Join(dir, "etcd"), "--quota-backend-bytes", strconv.FormatInt(quota, 10)); err != nil {
		return nil, err
	}
	if b.cli, err = testbed.EtcdClient([]string{b.etcd.Endpoint}); err != nil {
		return nil, err
	}
	var set *transformers.Set
	set, err = scaleTransformers(ctx, testbed.SecretsConfig(testbed.AESGCM(b.key1)).Render())
	if err != nil {
		return nil, err
	}
	defer set.Close()
	start := time.Now()
	if b.storedBytes, err = seedSecrets(ctx, b.cli, set.TransformerFor(secretsGR), n); err != nil {
		return nil, err
	}
	b.seedTime = time.Since(start)
	return b, nil
}

// shimPeakRSS is the shim's VmHWM in MiB.
func (b *scaleBed) shimPeakRSS() (float64, error) {
	v, err := testbed.PeakRSS(b.fleet.Shims[0].Current().PID())
	return float64(v) / (1 << 20), err
}

func (b *scaleBed) stop() {
	if b.cli != nil {
		b.cli.Close()
	}
	if b.fleet != nil {
		b.fleet.Stop()
	}
	if b.etcd != nil {
		b.etcd.Stop(10 * time.Second)
	}
}
