package bench

// etcd's own ceiling for the scale scenario's rewrite: how fast a bare client rewrites
// the same N stored Secrets in the same etcd, with none of rekey's work (no decryption,
// no encryption, no pacing, no checkpoints). A migration inside an apiserver cannot be
// faster than this on the same machine, so the idle migration's rate is judged against
// it as well as against the absolute target.

import (
	"context"
	"fmt"
	"io"
	"maps"
	"os"
	"path"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// measureCeilings measures etcd's own rate for the rewrite of the same n Secrets, each
// on a bed of its own seeded as rekey's was: etcd alone, then with an apiserver (rekey's
// layer, shimArgs) watching the Secrets. A fresh bed each: a pass right after a
// migration meets a database whose old revisions were just compacted, and etcd
// accepted a third of the rate there at a million Secrets (3,750 against 11,733
// objects/s), so the ceiling would not be the one rekey's migration met.
func measureCeilings(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, n int, quota int64, shimArgs []string, res *scaleResult) error {
	if err := migrateWithoutAPIServer(ctx, progress, filepath.Join(dir, "offline"), bins, n, quota, res); err != nil {
		return err
	}
	alone, err := startScaleEtcd(ctx, filepath.Join(dir, "alone"), bins, n, quota)
	if err != nil {
		return err
	}
	cpu := startCPUMeter(map[string]int{"etcd": alone.etcd.PID(), "bare client": os.Getpid()})
	m, e, err := etcdCeiling(ctx, alone.cli)
	res.ceilingAloneCPU = cpu.String()
	alone.stop()
	if err != nil {
		return err
	}
	if m != int64(n) {
		return fmt.Errorf("the bare pass put back %d of the %d Secrets seeded", m, n)
	}
	res.ceilingAlone = float64(m) / e.Seconds()

	watched, err := startScaleBed(ctx, filepath.Join(dir, "watched"), bins, "rekey", n, quota, shimArgs)
	if err != nil {
		return err
	}
	defer watched.stop()
	if err := waitWatchCacheFresh(ctx, watched); err != nil {
		return err
	}
	cpu = startCPUMeter(map[string]int{"etcd": watched.etcd.PID(), "apiserver": watched.fleet.Shims[0].Current().PID(), "bare client": os.Getpid()})
	w, d, err := etcdCeiling(ctx, watched.cli)
	res.ceilingWatchedCPU = cpu.String()
	if err != nil {
		return err
	}
	if w != int64(n) {
		return fmt.Errorf("the bare pass put back %d of the %d Secrets seeded", w, n)
	}
	res.ceilingWatched = float64(w) / d.Seconds()
	fmt.Fprintf(progress, "scale: etcd's ceiling for the rewrite (a bare client puts every Secret back, fresh beds): %.0f objects/s alone (%d in %v; %s), %.0f objects/s with an apiserver watching (%d in %v; %s)\n",
		res.ceilingAlone, m, e.Round(time.Millisecond), res.ceilingAloneCPU, res.ceilingWatched, w, d.Round(time.Millisecond), res.ceilingWatchedCPU)
	return nil
}

// migrateWithoutAPIServer runs rekey's migration (pkg/migrate, as `rekey migrate` runs
// it: paced by etcd's latency alone, the verifying re-scan included) from key1 to a
// new key on a fresh bed with no apiserver: the same code against etcd alone, for the
// rate etcd's ceiling allows it when nothing watches.
func migrateWithoutAPIServer(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, n int, quota int64, res *scaleResult) error {
	b, err := startScaleEtcd(ctx, dir, bins, n, quota)
	if err != nil {
		return err
	}
	defer b.stop()
	key2 := testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
	set, err := scaleTransformers(ctx, testbed.SecretsConfig(testbed.AESGCM(key2, b.key1)).Render())
	if err != nil {
		return err
	}
	defer set.Close()
	cpu := startCPUMeter(map[string]int{"etcd": b.etcd.PID(), "migration": os.Getpid()})
	start := time.Now()
	// The quota is the bed's, as the shim's --storage-migration-etcd-quota-bytes says.
	out, err := migrate.Migrate(ctx, migrate.Options{Client: b.cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{migrate.ResourceFor(scalePrefix, secretsGR)},
		Space: pace.SpaceOptions{QuotaBytes: quota}})
	took := time.Since(start)
	if err != nil {
		return fmt.Errorf("migrating with no apiserver: %w", err)
	}
	if out.Rewritten != int64(n) || out.Verified == nil || len(out.Verified.Resources) != 1 || out.Verified.Resources[0].Objects != int64(n) || out.Verified.Resources[0].Stale != 0 {
		return fmt.Errorf("migrating with no apiserver: %d of %d rewritten, or the re-scan did not find every one current", out.Rewritten, n)
	}
	res.offlineRate, res.offlineCPU = float64(n)/took.Seconds(), cpu.String()
	fmt.Fprintf(progress, "scale: rekey's migration with no apiserver (pkg/migrate against etcd alone): %.0f objects/s (%d in %v, the verifying re-scan included; %s)\n",
		res.offlineRate, n, took.Round(time.Millisecond), res.offlineCPU)
	return nil
}

// waitWatchCacheFresh returns once the shim's watch cache of Secrets has reached
// etcd's current revision: a get at that resource version is answered from the cache
// only then. Until it has, the cache's own list of every Secret would share the pass.
func waitWatchCacheFresh(ctx context.Context, b *scaleBed) error {
	resp, err := b.cli.Get(ctx, "watch-cache-probe")
	if err != nil {
		return err
	}
	rv := fmt.Sprint(resp.Header.Revision)
	c, err := b.fleet.Shims[0].Client()
	if err != nil {
		return err
	}
	_, ns, name := scaleSecretKey(0)
	ctx, cancel := context.WithTimeout(ctx, 10*time.Minute)
	defer cancel()
	for {
		_, err := c.CoreV1().Secrets(ns).Get(ctx, name, metav1.GetOptions{ResourceVersion: rv})
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("waiting for the apiserver's watch cache to reach revision %s: %w (last: %v)", rv, ctx.Err(), err)
		case <-time.After(time.Second):
		}
	}
}

// etcdCeiling puts every seeded Secret back unchanged, in the storage migration's
// shape: pages of migrate.DefaultPageSize read at the latest revision (one read ahead;
// namespace by namespace, see readPages),
// transactions of migrate.DefaultBatchSize puts, each guarded by a compare on the
// object's ModRevision, 2 × GOMAXPROCS transactions in flight (the migration's default
// workers). A put of the same bytes costs etcd what a rewrite costs: a new revision, a
// watch event with its previous value, and the same bytes in the WAL and the database.
// An apiserver watching the Secrets decodes the unchanged objects as it would rewritten
// ones.
func etcdCeiling(ctx context.Context, cli *clientv3.Client) (objects int64, took time.Duration, err error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	pages := make(chan []*mvccpb.KeyValue, 1)
	readErr := make(chan error, 1)
	go func() {
		defer close(pages)
		readErr <- readPages(ctx, cli, pages)
	}()

	var (
		done     atomic.Int64
		wg       sync.WaitGroup
		errOnce  sync.Once
		firstErr error
	)
	fail := func(err error) {
		errOnce.Do(func() { firstErr = err; cancel() })
	}
	inFlight := make(chan struct{}, 2*runtime.GOMAXPROCS(0))
	start := time.Now()
	for kvs := range pages {
		for lo := 0; lo < len(kvs); lo += migrate.DefaultBatchSize {
			batch := kvs[lo:min(lo+migrate.DefaultBatchSize, len(kvs))]
			select {
			case inFlight <- struct{}{}:
			case <-ctx.Done():
				continue
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				defer func() { <-inFlight }()
				if err := putBack(ctx, cli, batch); err != nil {
					fail(err)
					return
				}
				done.Add(int64(len(batch)))
			}()
		}
	}
	wg.Wait()
	took = time.Since(start)
	if err := <-readErr; err != nil && firstErr == nil {
		firstErr = err
	}
	if firstErr != nil {
		return done.Load(), took, fmt.Errorf("etcd ceiling: %w", firstErr)
	}
	return done.Load(), took, nil
}

// putBack writes a batch's values back as they are, in one transaction that holds
// only if none of them changed since it was read.
func putBack(ctx context.Context, cli *clientv3.Client, batch []*mvccpb.KeyValue) error {
	cmps := make([]clientv3.Cmp, len(batch))
	puts := make([]clientv3.Op, len(batch))
	for i, kv := range batch {
		cmps[i] = clientv3.Compare(clientv3.ModRevision(string(kv.Key)), "=", kv.ModRevision)
		puts[i] = clientv3.OpPut(string(kv.Key), string(kv.Value))
	}
	resp, err := cli.Txn(ctx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return err
	}
	if !resp.Succeeded {
		// Nothing else writes the N; a failed compare means the bed is not what the
		// measurement assumes.
		return fmt.Errorf("a Secret between %s and %s changed while it was put back", batch[0].Key, batch[len(batch)-1].Key)
	}
	return nil
}

// readPages sends the pages of every seeded Secret, at the latest revision each, one
// namespace's key range after another. etcd answers a range request with the count of
// every key up to the range's end, whatever the limit, so pages read up to the end of
// all Secrets cost a million-key walk each at a million (a bare pass ran at 3,700
// objects/s that way, etcd's one core busy counting); the migration bounds its reads to
// windows of a few pages for the same reason (pkg/migrate's pager). A namespace holds
// at most 10,000 of a million.
func readPages(ctx context.Context, cli *clientv3.Client, pages chan<- []*mvccpb.KeyValue) error {
	for ns := range scaleNamespaces {
		key, _, _ := scaleSecretKey(ns)
		prefix := path.Dir(key) + "/"
		end := clientv3.GetPrefixRangeEnd(prefix)
		from := prefix
		for {
			resp, err := cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithLimit(migrate.DefaultPageSize))
			if err != nil {
				return err
			}
			if len(resp.Kvs) > 0 {
				select {
				case pages <- resp.Kvs:
				case <-ctx.Done():
					return ctx.Err()
				}
			}
			if !resp.More || len(resp.Kvs) == 0 {
				break
			}
			from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
		}
	}
	return nil
}

// cpuMeter measures the cores each named process used over an interval.
type cpuMeter struct {
	pids  map[string]int
	from  map[string]time.Duration
	start time.Time
}

func startCPUMeter(pids map[string]int) *cpuMeter {
	m := &cpuMeter{pids: pids, from: map[string]time.Duration{}, start: time.Now()}
	for name, pid := range pids {
		m.from[name], _ = testbed.CPUTime(pid) // an unreadable one reads as 0 cores below
	}
	return m
}

// String is each process's cores since the start, e.g. "etcd 1.05, apiserver 0.62".
func (m *cpuMeter) String() string {
	elapsed := time.Since(m.start).Seconds()
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(m.pids)) {
		now, err := testbed.CPUTime(m.pids[name])
		if err != nil || m.from[name] == 0 {
			parts = append(parts, name+" ?")
			continue
		}
		parts = append(parts, fmt.Sprintf("%s %.2f", name, (now-m.from[name]).Seconds()/elapsed))
	}
	return strings.Join(parts, ", ") + " cores"
}
