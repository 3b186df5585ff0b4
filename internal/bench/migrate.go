package bench

import (
	"context"
	"fmt"
	"runtime"
	"sync"
	"sync/atomic"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	kruntime "k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// runMigrate measures storage migration against a real etcd process (so the heap
// figures are rekey's alone): re-encryption throughput with local providers and with
// KMS v2, and the time of an inventory. Upstream has no migration of its own (its
// procedure is a no-op `kubectl replace` of every object), so these are absolute
// figures against the targets.
func runMigrate(s Settings) ([]Row, error) {
	b, err := startBed(s, "rkm", "", bedOptions{etcd: true, client: true})
	if err != nil {
		return nil, err
	}
	defer b.close()
	ctx, cli := b.ctx, b.cli
	env, err := startKMS()
	if err != nil {
		return nil, err
	}
	defer env.close()

	n, invN := 10_000, 100_000
	if s.Short {
		n, invN = 5_000, 20_000
	}
	k0, k1 := randomKey(32), randomKey(32)
	local := func(first, second string) string { return twoAESGCMKeysConfig(first, second, k0, k1) }
	factory := kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: metrics.NewKubeRegistry()})
	build := func(yaml string) (*transformers.Set, error) { return buildReadySet(ctx, factory, yaml) }
	res := migrate.ResourceFor(migrate.DefaultEtcdPrefix, schema.GroupResource{Resource: "secrets"})

	// Seed n objects under k0.
	seed, err := build(local("k0", "k1"))
	if err != nil {
		return nil, err
	}
	if err := putObjects(ctx, cli, seed.TransformerFor(secretsGR), res.KeyPrefix, "bench", n); err != nil {
		return nil, err
	}
	seed.Close()

	migrateOnce := func(yaml string) (float64, float64, error) {
		set, err := build(yaml)
		if err != nil {
			return 0, 0, err
		}
		defer set.Close()
		peak := sampleHeap()
		result, err := migrate.Migrate(ctx, migrate.Options{Client: cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{res}})
		heap := peak()
		if err != nil {
			return 0, 0, err
		}
		if result.Rewritten != int64(n) {
			return 0, 0, fmt.Errorf("migration rewrote %d of %d objects", result.Rewritten, n)
		}
		return float64(n) / result.Duration.Seconds(), heap, nil
	}
	var localRates, kmsRates, localHeap, kmsHeap []float64
	for r := 0; r < s.Rounds; r++ {
		// Alternate the write key so every round rewrites every object.
		first, second := "k1", "k0"
		if r%2 == 1 {
			first, second = "k0", "k1"
		}
		rate, heap, err := migrateOnce(local(first, second))
		if err != nil {
			return nil, err
		}
		localRates, localHeap = append(localRates, rate), append(localHeap, heap)
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "migrate local round %d: %.0f objects/s, peak heap +%.1f MiB\n", r, rate, heap)
		}
	}
	// Make sure everything is on k0 before the KMS rounds (which read k0).
	if s.Rounds%2 == 1 {
		if _, _, err := migrateOnce(local("k0", "k1")); err != nil {
			return nil, err
		}
	}
	for r := 0; r < s.Rounds; r++ {
		// aesgcm → KMS v2, then KMS v2 → aesgcm: every round involves the plugin.
		rate, heap, err := migrateOnce(aesgcmAndKMSConfig(k0, env.endpoint, "bench-mig", r%2 == 0))
		if err != nil {
			return nil, err
		}
		kmsRates, kmsHeap = append(kmsRates, rate), append(kmsHeap, heap)
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "migrate kms round %d: %.0f objects/s, peak heap +%.1f MiB\n", r, rate, heap)
		}
	}

	// Inventory of invN objects (add the missing ones under another namespace).
	inv, err := build(local("k0", "k1"))
	if err != nil {
		return nil, err
	}
	defer inv.Close()
	if err := putObjects(ctx, cli, inv.TransformerFor(secretsGR), res.KeyPrefix, "inventory", invN-n); err != nil {
		return nil, err
	}
	invTimes, invHeap, err := inventoryRounds(ctx, cli, inv, res, invN, s.Rounds)
	if err != nil {
		return nil, err
	}
	return migrateRows(n, invN, localRates, kmsRates, invTimes, localHeap, kmsHeap, invHeap), nil
}

// inventoryRounds takes rounds inventories of res (invN objects) with set: their
// times in seconds and peak heap growths in MiB.
func inventoryRounds(ctx context.Context, cli *clientv3.Client, set *transformers.Set, res migrate.Resource, invN, rounds int) (times, heaps []float64, err error) {
	for r := 0; r < rounds; r++ {
		peak := sampleHeap()
		start := time.Now()
		got, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{res}})
		d := time.Since(start)
		heaps = append(heaps, peak())
		if err != nil {
			return nil, nil, err
		}
		if c := got.Find("secrets").Objects; c != int64(invN) {
			return nil, nil, fmt.Errorf("inventory counted %d objects, want %d", c, invN)
		}
		times = append(times, d.Seconds())
	}
	return times, heaps, nil
}

// migrateRows are the migrate scenario's rows from its rounds' figures, with the
// issue's targets checked.
func migrateRows(n, invN int, localRates, kmsRates, invTimes, localHeap, kmsHeap, invHeap []float64) []Row {
	fig := func(unit string, xs []float64, higher bool) Figure {
		return wholeRunFigure("rekey", unit, summarize(xs), higher)
	}
	sc := "storage migration (etcd process)"
	rows := []Row{
		{Scenario: sc, Case: fmt.Sprintf("re-encrypt %d Secrets, aesgcm key → new aesgcm key", n), Figures: []Figure{fig("objects/s", localRates, true)}},
		{Scenario: sc, Case: fmt.Sprintf("re-encrypt %d Secrets, aesgcm ↔ KMS v2", n), Figures: []Figure{fig("objects/s", kmsRates, true)}},
		{Scenario: sc, Case: fmt.Sprintf("inventory of %d Secrets", invN), Figures: []Figure{fig("s", invTimes, false)}},
		{Scenario: sc, Case: fmt.Sprintf("peak heap growth: migrating %d / inventory of %d", n, invN), Figures: []Figure{
			{Impl: "rekey", Unit: "MiB", Stats: Stats{Median: summarize(localHeap).Median, Min: summarize(kmsHeap).Median, Max: summarize(invHeap).Median}, Allocs: -1, Bytes: -1, Retained: -1,
				Note: fmt.Sprintf("%.1f MiB (local) / %.1f MiB (KMS) / %.1f MiB (inventory)", summarize(localHeap).Median, summarize(kmsHeap).Median, summarize(invHeap).Median)}}},
	}
	rows[0].Checks = []Check{{Desc: "≥ 2,000 objects/s", Met: rows[0].Figures[0].Stats.Median >= 2000, Got: fmt.Sprintf("%.0f/s", rows[0].Figures[0].Stats.Median)}}
	rows[1].Checks = []Check{{Desc: "≥ 1,000 objects/s", Met: rows[1].Figures[0].Stats.Median >= 1000, Got: fmt.Sprintf("%.0f/s", rows[1].Figures[0].Stats.Median)}}
	perObj := rows[2].Figures[0].Stats.Median / float64(invN) * 100_000
	rows[2].Checks = []Check{{Desc: "100,000 objects in < 10 s", Met: perObj < 10, Got: fmt.Sprintf("%.2f s per 100,000", perObj)}}
	return rows
}

// twoAESGCMKeysConfig encrypts Secrets with aesgcm key first and reads second too (k0
// and k1 are the secrets of the keys so named).
func twoAESGCMKeysConfig(first, second, k0, k1 string) string {
	keys := map[string]string{"k0": k0, "k1": k1}
	return fmt.Sprintf("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n            - {name: %s, secret: %s}\n            - {name: %s, secret: %s}\n", first, keys[first], second, keys[second])
}

// aesgcmAndKMSConfig encrypts Secrets with the KMS v2 provider kmsName at endpoint
// when kmsFirst, else with aesgcm key k0, and reads the other too.
func aesgcmAndKMSConfig(k0, endpoint, kmsName string, kmsFirst bool) string {
	kms := fmt.Sprintf("      - kms:\n          apiVersion: v2\n          name: %s\n          endpoint: %s\n          timeout: 3s\n", kmsName, endpoint)
	gcm := fmt.Sprintf("      - aesgcm:\n          keys:\n            - {name: k0, secret: %s}\n", k0)
	head := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n"
	if kmsFirst {
		return head + kms + gcm
	}
	return head + gcm + kms
}

// buildReadySet builds the configuration yaml with factory and waits (10 s each) for
// its KMS providers to be ready.
func buildReadySet(ctx context.Context, factory transformers.KMSFactory, yaml string) (*transformers.Set, error) {
	cfg, err := config.Parse([]byte(yaml), "bench", config.Options{})
	if err != nil {
		return nil, err
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: factory})
	if err != nil {
		return nil, err
	}
	for _, k := range set.KMSProviders() {
		wctx, cancel := context.WithTimeout(ctx, 10*time.Second)
		err := k.WaitReady(wctx)
		cancel()
		if err != nil {
			set.Close()
			return nil, err
		}
	}
	return set, nil
}

// putObjects stores count objects of about 300 bytes under prefix/ns/, encrypted with t
// (the etcd key is the authenticated data, as in the apiserver).
func putObjects(ctx context.Context, cli *clientv3.Client, t value.Transformer, prefix, ns string, count int) error {
	var next atomic.Int64
	var firstErr error
	var once sync.Once
	var wg sync.WaitGroup
	// A stored object in kube-apiserver's protobuf envelope (migration refuses to
	// rewrite anything else), about 300 bytes.
	u := kruntime.Unknown{TypeMeta: kruntime.TypeMeta{APIVersion: "v1", Kind: "Secret"}, Raw: make([]byte, 270)}
	raw, err := u.Marshal()
	if err != nil {
		return err
	}
	payload := append([]byte("k8s\x00"), raw...)
	for w := 0; w < 8; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for {
				i := next.Add(1) - 1
				if i >= int64(count) {
					return
				}
				key := fmt.Sprintf("%s%s/obj-%07d", prefix, ns, i)
				v, err := t.TransformToStorage(ctx, payload, value.DefaultContext(key))
				if err == nil {
					_, err = cli.Put(ctx, key, string(v))
				}
				if err != nil {
					once.Do(func() { firstErr = err })
					return
				}
			}
		}()
	}
	wg.Wait()
	return firstErr
}

// sampleHeap samples the live heap every 5 ms; the returned function stops sampling and
// reports the peak growth in MiB over the heap at the start.
func sampleHeap() func() float64 {
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	var peak atomic.Uint64
	stop := make(chan struct{})
	done := make(chan struct{})
	go func() {
		defer close(done)
		t := time.NewTicker(5 * time.Millisecond)
		defer t.Stop()
		for {
			select {
			case <-stop:
				return
			case <-t.C:
				var m runtime.MemStats
				runtime.ReadMemStats(&m)
				if m.HeapAlloc > peak.Load() {
					peak.Store(m.HeapAlloc)
				}
			}
		}
	}()
	return func() float64 {
		close(stop)
		<-done
		p := peak.Load()
		if p < base {
			return 0
		}
		return float64(p-base) / (1 << 20)
	}
}
