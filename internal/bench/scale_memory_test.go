package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// The memory of an inventory and a migration is bounded in the number of objects: both
// read etcd page by page, so at 4N the peak heap is about what it is at N, and the time
// about four times. Measured in this process (pkg/migrate, the code the apiserver and
// rekey run) against an etcd process, N = 20,000 and 80,000 Secrets of the scale
// scenario's sizes; REKEY_BENCH_SCALE_MEMORY=1 runs it (a minute or two), and
// REKEY_BENCH_SCALE_MEMORY_SIZES=20000,80000,160000 measures other sizes against the first.
func TestScaleMemoryBoundedInN(t *testing.T) {
	if os.Getenv("REKEY_BENCH_SCALE_MEMORY") != "1" {
		t.Skip("REKEY_BENCH_SCALE_MEMORY=1 measures inventory and migration memory at N and 4N")
	}
	ctx := t.Context()
	dir := t.TempDir()
	bins, err := testbed.Build(ctx, filepath.Join(dir, "bin"))
	if err != nil {
		t.Fatal(err)
	}
	type figures struct {
		invHeap, migHeap float64 // MiB of peak heap growth
		inv, mig         time.Duration
	}
	measure := func(n int) figures {
		etcd, err := testbed.StartEtcdWith(ctx, bins.Etcd, filepath.Join(dir, fmt.Sprint(n)), "--quota-backend-bytes", fmt.Sprint(defaultScaleQuota))
		if err != nil {
			t.Fatal(err)
		}
		defer etcd.Stop(10 * time.Second)
		cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
		if err != nil {
			t.Fatal(err)
		}
		defer cli.Close()
		key1 := testbed.NamedKey{Name: "key1", Secret: testbed.RandomKey()}
		key2 := testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
		seed, err := scaleTransformers(ctx, testbed.SecretsConfig(testbed.AESGCM(key1)).Render())
		if err != nil {
			t.Fatal(err)
		}
		defer seed.Close()
		if _, err := seedSecrets(ctx, cli, seed.TransformerFor(secretsGR), n); err != nil {
			t.Fatal(err)
		}
		set, err := scaleTransformers(ctx, testbed.SecretsConfig(testbed.AESGCM(key2, key1)).Render())
		if err != nil {
			t.Fatal(err)
		}
		defer set.Close()
		var f figures
		peak := sampleHeap()
		inv, d, err := scaleInventory(context.Background(), cli, set)
		f.invHeap, f.inv = peak(), d
		if err != nil {
			t.Fatal(err)
		}
		if inv.Objects != int64(n) || inv.Stale != int64(n) {
			t.Fatalf("inventory of %d Secrets: %d objects, %d stale", n, inv.Objects, inv.Stale)
		}
		peak = sampleHeap()
		start := time.Now()
		res, err := migrate.Migrate(ctx, migrate.Options{Client: cli, Source: migrate.FromSet(set), Resources: []migrate.Resource{migrate.ResourceFor(scalePrefix, secretsGR)}})
		f.migHeap, f.mig = peak(), time.Since(start)
		if err != nil {
			t.Fatal(err)
		}
		if res.Rewritten != int64(n) {
			t.Fatalf("migration rewrote %d of %d Secrets", res.Rewritten, n)
		}
		t.Logf("N=%d: inventory %v, peak heap +%.1f MiB; migration %v (%.0f objects/s), peak heap +%.1f MiB",
			n, f.inv.Round(time.Millisecond), f.invHeap, f.mig.Round(time.Millisecond), float64(n)/f.mig.Seconds(), f.migHeap)
		return f
	}
	sizes, err := scaleMemorySizes(os.Getenv("REKEY_BENCH_SCALE_MEMORY_SIZES"))
	if err != nil {
		t.Fatal(err)
	}
	small := measure(sizes[0])
	for _, n := range sizes[1:] {
		large := measure(n)
		t.Logf("%d / %d objects (×%.1f): inventory time ×%.2f, heap ×%.2f; migration time ×%.2f, heap ×%.2f", n, sizes[0], float64(n)/float64(sizes[0]),
			large.inv.Seconds()/small.inv.Seconds(), large.invHeap/small.invHeap, large.mig.Seconds()/small.mig.Seconds(), large.migHeap/small.migHeap)
		// Bounded: at four (or more) times the objects, at most half again the peak heap
		// (plus a few MiB of sampling noise). Growing with N would be about ×4.
		for _, c := range []struct {
			what        string
			atMore, atN float64
		}{{"inventory", large.invHeap, small.invHeap}, {"migration", large.migHeap, small.migHeap}} {
			if c.atMore > 1.5*c.atN+8 {
				t.Errorf("%s: peak heap +%.1f MiB at %d Secrets vs +%.1f MiB at %d: it grows with the number of objects", c.what, c.atMore, n, c.atN, sizes[0])
			}
		}
	}
}

// scaleMemorySizes parses REKEY_BENCH_SCALE_MEMORY_SIZES, a comma-separated list of
// object counts, smallest first; empty means N = 20,000 and 4N = 80,000. Every size
// after the first is compared with the first.
func scaleMemorySizes(list string) ([]int, error) {
	if list == "" {
		return []int{20_000, 80_000}, nil
	}
	var sizes []int
	for f := range strings.SplitSeq(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(f))
		if err != nil || n <= 0 || len(sizes) > 0 && n <= sizes[len(sizes)-1] {
			return nil, fmt.Errorf("REKEY_BENCH_SCALE_MEMORY_SIZES=%q: want positive object counts, ascending, separated by commas (e.g. 20000,80000,160000)", list)
		}
		sizes = append(sizes, n)
	}
	if len(sizes) < 2 {
		return nil, fmt.Errorf("REKEY_BENCH_SCALE_MEMORY_SIZES=%q: want at least two sizes, the first one the base of the comparison", list)
	}
	return sizes, nil
}
