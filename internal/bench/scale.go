package bench

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"path/filepath"
	"slices"
	"strconv"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// The scale scenario rotates the local key of N Secrets (default 1,000,000) of 1–10 KiB
// stored in an etcd process with a 2 GiB quota, on one apiserver, twice, each side on a
// fresh testbed (scale_bed.go):
//
//   - rekey: the shim runs rekey's layer; the config file's write key changes from key1
//     to key2 and the shim's own migration re-encrypts every Secret; the side ends when
//     the migration record of secrets is verified on key2.
//   - upstream: the shim runs k8s.io/apiserver's layer (--encryption-layer=upstream, its
//     1-minute file poll untouched); key2 is added for reads, then promoted, then every
//     Secret is rewritten through the API as `kubectl get secrets -A -o json | kubectl
//     replace -f -` does (scale_upstream.go); the side ends when that is done.
//
// Each side then takes a fresh inventory to check every stored Secret is under key2.
// After rekey's side, etcd's own ceiling for the rewrite is measured on two more fresh
// beds (scale_ceiling.go): a bare client puts every Secret back, with etcd alone and
// with an apiserver watching; the idle target is judged against it as well.
// Both sides run the same client workload through the shim for the whole run (a
// baseline window before the rotation, then the window of the migration), and a
// poller reads etcd's database size and alarms every second. Compaction is the shim's:
// k8s.io/apiserver's storage backend compacts every 5 minutes, as kube-apiserver does;
// nothing defragments.

// ScaleSides are the sides the scale scenario can run.
var scaleSides = []string{"rekey", "upstream"}

// scaleClientRate is the client workload's rate in requests per second, over
// scaleClientWorkers workers.
const (
	scaleClientRate = 30
	// scaleRekeyLimit bounds the wait for rekey's migration to be verified.
	scaleRekeyLimit    = 2 * time.Hour
	scaleClientWorkers = 6
)

// scaleResult is what one side measured.
type scaleResult struct {
	side    string
	objects int
	// seedTime is writing the N into etcd; inventory a fresh inventory of them before
	// the rotation.
	seedTime, inventory time.Duration
	storedBytes         int64
	// migration is from the start of the rewrite (rekey: the config edit; upstream: the
	// start of the replace, after the promotion is served) to verified or done;
	// total from the first config edit.
	migration, total time.Duration
	// rewritten is how many Secrets the migration handled; extrapolated says the
	// upstream rewrite hit its time limit and migration is extrapolated from its rate.
	rewritten    int64
	extrapolated bool
	// underKey2 of stored Secrets are under key2 at the end (fresh inventory).
	underKey2, stored int64
	db                *dbWatch
	baseline, during  clientWindow
	// peakRSS is the shim's VmHWM at the end, peakRSSBefore just before the first
	// config edit (start-up, its watch cache of every Secret, the baseline load): the
	// migration raised the peak only when the two differ.
	peakRSS, peakRSSBefore float64 // MiB
	conflicts              int64
	// rewrite is rekey's rewrite alone: from the config edit to the first sight of the
	// verifying re-scan (0 when not seen, or on upstream's side).
	rewrite time.Duration
	// ceilingWatched and ceilingAlone are etcd's own rate for the same rewrite
	// (scale_ceiling.go), with the apiserver watching and with it stopped; rekey's
	// side only, 0 when not measured.
	ceilingWatched, ceilingAlone float64
	// The cores each process used: during rekey's migration (edit → verified) and
	// during the ceiling's passes.
	migrationCPU, ceilingWatchedCPU, ceilingAloneCPU string
	// offlineRate is rekey's migration (pkg/migrate) against etcd alone, on a fresh bed
	// (edit → verified; 0 when not measured).
	offlineRate float64
	offlineCPU  string
}

// runScale runs each side on its own fresh testbed, one after the other.
func runScale(s Settings) ([]Row, error) {
	n := s.ScaleObjects
	if n <= 0 {
		n = 1_000_000
		if s.Short {
			n = 20_000
		}
	}
	sides := s.ScaleSides
	if len(sides) == 0 {
		sides = scaleSides
		if s.Short {
			// Upstream's side waits for two of its layer's 1-minute file polls: alone it
			// takes longer than the short run's two minutes (-scale-sides names it).
			sides = []string{"rekey"}
		}
	}
	if err := checkSides("scale", sides, scaleSides); err != nil {
		return nil, err
	}
	baseline := s.ScaleBaseline
	if baseline <= 0 {
		baseline = time.Minute
		switch {
		case s.Short:
			baseline = 10 * time.Second
		case n >= scaleLongBaselineFrom:
			baseline = 5 * time.Minute
		}
	}
	limit := s.ScaleUpstreamLimit
	if limit <= 0 {
		limit = 20 * time.Minute
	}
	quota := s.ScaleQuotaBytes
	if quota <= 0 {
		quota = defaultScaleQuota
	}
	if s.ScaleIdle {
		// No client workload: a few seconds for the shim's start-up to settle.
		baseline = 5 * time.Second
	}
	run, err := startProcessRun(s, "rks", "scale: building the shim and etcd binaries")
	if err != nil {
		return nil, err
	}
	defer run.close()
	ctx, dir, progress, bins := run.ctx, run.dir, run.progress, run.bins
	results := map[string]*scaleResult{}
	for _, side := range sides {
		fmt.Fprintf(progress, "scale: side %s, %d Secrets\n", side, n)
		// Both sides: see scaleCommonShimArgs.
		args := slices.Clone(scaleCommonShimArgs)
		if side == "rekey" {
			args = append(args, "--storage-migration-etcd-quota-bytes", strconv.FormatInt(quota, 10))
			if s.ScaleMigrationRate > 0 {
				args = append(args, "--storage-migration-rate", strconv.FormatFloat(s.ScaleMigrationRate, 'f', -1, 64))
			}
			args = append(args, s.ScaleShimFlags...)
		}
		clients := float64(scaleClientRate)
		if s.ScaleIdle {
			clients = 0
		}
		r, err := scaleOnce(ctx, progress, filepath.Join(dir, side), bins, side, scaleRun{n: n, quota: quota, clientRate: clients, opsDir: s.ScaleOpsDir}, baseline, limit, args)
		if err != nil {
			return nil, fmt.Errorf("scale side %s: %w", side, err)
		}
		fmt.Fprintf(progress, "scale: %s: migration %v (%.0f objects/s), DB %.0f MiB seeded, %.0f MiB peak, %d NOSPACE alarms, client p99 %.1f → %.1f ms, shim peak RSS %.0f MiB before the rotation, %.0f MiB at the end\n",
			side, r.migration.Round(time.Millisecond), scaleRate(r), float64(r.db.firstSize)/(1<<20), float64(r.db.peakSize)/(1<<20), r.db.noSpace, r.baseline.p99, r.during.p99, r.peakRSSBefore, r.peakRSS)
		if side == "rekey" {
			if err := measureCeilings(ctx, progress, filepath.Join(dir, "ceiling"), bins, n, quota, args, r); err != nil {
				return nil, fmt.Errorf("scale: etcd's ceiling: %w", err)
			}
		}
		results[side] = r
	}
	return scaleRows(results, n, quota, s.ScaleIdle, s.ScaleMigrationRate), nil
}

// scaleCommonShimArgs are both sides' shim flags. The generic apiserver's watch-cache
// consistency check (DetectCacheInconsistency, beta and on since Kubernetes 1.34) lists
// every object from etcd every 5–7.5 minutes; at a million Secrets that is a minute in
// which the clients' p99 was 280–870 ms, with or without a migration. A one-minute
// baseline cannot hold one while a migration's window always does, so the ratio would
// measure the check, not the migration: it is off on both sides (BENCHMARKS.md has its
// own figures).
var scaleCommonShimArgs = []string{"--feature-gates=DetectCacheInconsistency=false"}

// scaleLongBaselineFrom: from this many Secrets the baseline lasts 5 minutes. A
// garbage collection of the apiserver's watch cache, gigabytes at a million Secrets,
// and etcd's 5-minute compaction each slow the clients for seconds; a one-minute
// baseline rarely holds one, the migration's window always does, and the ratio would
// measure them instead of the migration.
const scaleLongBaselineFrom = 500_000

// scaleWarmup is how long the client workload runs before its baseline is counted (at
// most a third of the baseline).
const scaleWarmup = 20 * time.Second

// scaleRun is what one side stores and runs against.
type scaleRun struct {
	n     int
	quota int64
	// clientRate is the client workload's requests per second; 0: none (idle).
	clientRate float64
	// opsDir: see Settings.ScaleOpsDir.
	opsDir string
}

// scaleOnce runs one side: testbed, inventory, baseline window, rotation, end check.
func scaleOnce(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, side string, sr scaleRun, baseline, limit time.Duration, shimArgs []string) (*scaleResult, error) {
	n := sr.n
	logf := func(format string, args ...any) {
		fmt.Fprintf(progress, "scale: %s: "+format+"\n", append([]any{side}, args...)...)
	}
	b, err := startScaleBed(ctx, dir, bins, side, n, sr.quota, shimArgs)
	if err != nil {
		return nil, err
	}
	defer b.stop()
	res := &scaleResult{side: side, objects: n, seedTime: b.seedTime, storedBytes: b.storedBytes}
	logf("%d Secrets (%.0f MiB stored) written into etcd under key1 in %v", n, float64(b.storedBytes)/(1<<20), b.seedTime.Round(time.Millisecond))
	db := watchDB(b.cli, b.etcd.Endpoint)
	defer func() {
		if res.db == nil {
			db.Stop()
		}
	}()

	key2 := testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
	readBoth, err := scaleTransformers(ctx, testbed.SecretsConfig(testbed.AESGCM(key2, b.key1)).Render())
	if err != nil {
		return nil, err
	}
	defer readBoth.Close()
	inv, d, err := scaleInventory(ctx, b.cli, readBoth)
	if err != nil {
		return nil, err
	}
	res.inventory = d
	logf("a fresh inventory of %d Secrets took %v", inv.Objects, d.Round(time.Millisecond))

	c, err := b.fleet.Shims[0].Client()
	if err != nil {
		return nil, err
	}
	load := startClientLoad(ctx, c, sr.clientRate, scaleClientWorkers)
	loadStopped := false
	defer func() {
		if !loadStopped {
			load.Stop()
		}
	}()
	baseStart, err := warmUpThenBaseline(ctx, baseline)
	if err != nil {
		return nil, err
	}
	if res.peakRSSBefore, err = b.shimPeakRSS(); err != nil {
		return nil, err
	}
	var migStart, migEnd, firstEdit time.Time
	switch side {
	case "rekey":
		firstEdit, migStart, migEnd, err = rotateRekeyAtScale(ctx, logf, b, key2, limit, res)
		if err != nil {
			return nil, err
		}
	case "upstream":
		firstEdit, migStart, migEnd, err = rotateUpstreamAtScale(ctx, logf, b, key2, limit, res)
		if err != nil {
			return nil, err
		}
	}
	// The "during" window ends with the migration; the workload stops a moment later.
	time.Sleep(time.Second)
	ops := load.Stop()
	loadStopped = true
	res.baseline, res.during = windowOf(ops, baseStart, firstEdit), windowOf(ops, migStart, migEnd)
	if sr.opsDir != "" {
		if err := writeClientOps(filepath.Join(sr.opsDir, side+"-client-ops.csv"), ops, baseStart, firstEdit, migStart, migEnd); err != nil {
			return nil, err
		}
	}
	res.migration, res.total = migEnd.Sub(migStart), migEnd.Sub(firstEdit)
	if res.extrapolated {
		res.migration = time.Duration(float64(migEnd.Sub(migStart)) * float64(n) / float64(max(res.rewritten, 1)))
		res.total = migStart.Sub(firstEdit) + res.migration
	}
	if res.peakRSS, err = b.shimPeakRSS(); err != nil {
		return nil, err
	}
	res.db = db.Stop()
	end, _, err := scaleInventory(ctx, b.cli, readBoth)
	if err != nil {
		return nil, err
	}
	res.stored, res.underKey2 = end.Objects, end.Objects-end.Stale-end.Unreadable-end.Plaintext
	logf("end: %d of %d stored Secrets under key2; client baseline %d requests (%d failed), during %d (%d failed)",
		res.underKey2, res.stored, res.baseline.requests, res.baseline.failed, res.during.requests, res.during.failed)
	return res, nil
}

// warmUpThenBaseline waits out the client load's warm-up, then its baseline window,
// which it returns the start of. The first requests after the start-up (a watch cache
// of a million objects just filled, its garbage being collected) are slower than the
// cluster's usual; they would flatter every ratio to the baseline.
func warmUpThenBaseline(ctx context.Context, baseline time.Duration) (time.Time, error) {
	select {
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	case <-time.After(min(scaleWarmup, baseline/3)):
	}
	baseStart := time.Now()
	select {
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	case <-time.After(baseline):
	}
	return baseStart, nil
}

// rotateRekeyAtScale is the rekey side's rotation: one edit of the shim's file (key2
// first), then the storage migration until it is verified (its limit is upstream's
// replace's or more: rekey's migration is not cut short); res gets what was rewritten,
// how long the rewrite took and the CPU it used.
func rotateRekeyAtScale(ctx context.Context, logf func(string, ...any), b *scaleBed, key2 testbed.NamedKey, limit time.Duration, res *scaleResult) (firstEdit, migStart, migEnd time.Time, err error) {
	cpu := startCPUMeter(map[string]int{"etcd": b.etcd.PID(), "apiserver": b.fleet.Shims[0].Current().PID()})
	firstEdit = time.Now()
	migStart = firstEdit
	if err := testbed.WriteFileAtomic(b.fleet.Shims[0].ConfigPath, testbed.SecretsConfig(testbed.AESGCM(key2, b.key1)).Render()); err != nil {
		return firstEdit, migStart, migEnd, err
	}
	var rewriteEnd time.Time
	migEnd, rewriteEnd, err = waitVerified(ctx, b, key2.Name, firstEdit, max(limit, scaleRekeyLimit))
	if err != nil {
		return firstEdit, migStart, migEnd, err
	}
	res.rewritten = int64(res.objects)
	res.migrationCPU = cpu.String()
	logf("edit → verified: %s", res.migrationCPU)
	if !rewriteEnd.IsZero() {
		res.rewrite = rewriteEnd.Sub(firstEdit)
	}
	return firstEdit, migStart, migEnd, nil
}

// waitVerified polls the migration leader's state in etcd until the record of secrets
// is verified on key and was started after since, and returns when it was seen, and
// when the verifying re-scan's progress was first seen (zero if never).
func waitVerified(ctx context.Context, b *scaleBed, key string, since time.Time, limit time.Duration) (verified, rescan time.Time, err error) {
	ctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	stateKey := coordination.MigrationState(coordination.DefaultPrefix)
	last := "no migration state yet"
	for {
		resp, err := b.cli.Get(ctx, stateKey)
		if err == nil && len(resp.Kvs) == 1 {
			var st cluster.MigrationState
			if err := json.Unmarshal(resp.Kvs[0].Value, &st); err != nil {
				return time.Time{}, time.Time{}, fmt.Errorf("decoding %s: %w", stateKey, err)
			}
			if r, ok := st.Records["secrets"]; ok {
				if r.Verified && r.Target.Key == key && !r.StartedAt.Before(since.Add(-time.Second)) {
					return time.Now(), rescan, nil
				}
				last = fmt.Sprintf("record %+v", r)
			}
			if st.Progress != nil {
				if st.Progress.Phase == "verify" && st.Progress.Resource == "secrets" && rescan.IsZero() {
					rescan = time.Now()
				}
				last += fmt.Sprintf("; progress %s %d/%d", st.Progress.Phase, st.Progress.Done, st.Progress.Total)
			}
		}
		select {
		case <-ctx.Done():
			return time.Time{}, time.Time{}, fmt.Errorf("waiting for the migration of secrets to %s to be verified: %w (%s)\n%s", key, ctx.Err(), last, b.fleet.LogTails(3000))
		case <-time.After(200 * time.Millisecond):
		}
	}
}

// scaleRate is the migration's objects/s.
func scaleRate(r *scaleResult) float64 {
	if r.migration <= 0 {
		return 0
	}
	return float64(r.objects) / r.migration.Seconds()
}

// scaleRows turns the sides' results into rows: rekey first, upstream second.
func scaleRows(res map[string]*scaleResult, n int, quota int64, idle bool, migrationRate float64) []Row {
	load := "a client workload of 30 requests/s"
	if idle {
		load = "no client workload"
	}
	scenario := fmt.Sprintf("scale (%s Secrets of 1–10 KiB, 1 apiserver, etcd with a %s quota, %s)", groupThousands(int64(n)), quotaText(quota), load)
	impls := []string{"rekey (storage migration)", "upstream (kubectl get + replace)"}
	if migrationRate > 0 {
		impls[0] = fmt.Sprintf("rekey (storage migration at ≤ %g objects/s)", migrationRate)
	}
	row := func(c, unit string, higher bool, value func(*scaleResult) float64) Row {
		r := Row{Scenario: scenario, Case: c}
		for i, side := range scaleSides {
			f := wholeRunFigure(impls[i], unit, single(0), higher)
			if res[side] == nil {
				f.Note = "not run"
			} else {
				f.Stats = single(value(res[side]))
			}
			r.Figures = append(r.Figures, f)
		}
		return r
	}
	mib := func(v int64) float64 { return float64(v) / (1 << 20) }
	inventory := row("fresh inventory of the N (pkg/migrate, the scan of rekey inventory)", "s", false, func(r *scaleResult) float64 { return r.inventory.Seconds() })
	// The harness scans both sides' etcd, but the scan is rekey's code: upstream has none.
	inventory.Figures[1].Stats, inventory.Figures[1].Note = single(0), "upstream has no inventory"
	throughput := row("migration throughput: rewrite start → verified (rekey) / every Secret replaced (upstream)", "objects/s", true, scaleRate)
	if u := res["upstream"]; u != nil && u.extrapolated {
		throughput.Figures[1].Note = fmt.Sprintf("%.0f objects/s (%d of %d replaced in the time limit; the time is extrapolated)", scaleRate(u), u.rewritten, u.objects)
	}
	rekeyOnly := func(r Row, note string) Row {
		r.Figures[1].Stats, r.Figures[1].Note = single(0), note
		return r
	}
	rewriteRate := rekeyOnly(row("rewrite only: config edit → verifying re-scan started", "objects/s", true, func(r *scaleResult) float64 {
		if r.rewrite <= 0 {
			return 0
		}
		return float64(r.objects) / r.rewrite.Seconds()
	}), "the same as its throughput: upstream has no re-scan")
	if r := res["rekey"]; r != nil && r.rewrite <= 0 {
		// The state is polled every 200 ms: a re-scan shorter than that can start
		// and end between two polls.
		rewriteRate.Figures[0].Note = "not observed: the verifying re-scan began and ended between two polls of the migration state"
	}
	ceilingWatched := rekeyOnly(row("etcd's own ceiling: a bare client puts every Secret back unchanged in the migration's transactions, an apiserver watching (fresh bed)", "objects/s", true,
		func(r *scaleResult) float64 { return r.ceilingWatched }), "measured once, on fresh beds seeded as the sides'")
	ceilingAlone := rekeyOnly(row("etcd's own ceiling, etcd alone (fresh bed)", "objects/s", true,
		func(r *scaleResult) float64 { return r.ceilingAlone }), "measured once, on fresh beds seeded as the sides'")
	offline := rekeyOnly(row("rekey's migration with no apiserver: pkg/migrate against etcd alone, as `rekey migrate` runs it, re-scan included (fresh bed)", "objects/s", true,
		func(r *scaleResult) float64 { return r.offlineRate }), "measured once, on fresh beds seeded as the sides'")
	if r := res["rekey"]; r != nil && idle {
		rate := scaleRate(r)
		throughput.Checks = append(throughput.Checks, Check{Desc: "rekey: ≥ 20,000 objects/s idle", Met: rate >= 20_000,
			Got: fmt.Sprintf("%.0f objects/s end to end, %.0f while rewriting; etcd on this machine: %.0f with an apiserver watching, %.0f alone; rekey's migration with no apiserver %.0f",
				rate, rewriteRate.Figures[0].Stats.Median, r.ceilingWatched, r.ceilingAlone, r.offlineRate)})
	}
	total := row("first config edit → all Secrets under key2", "s", false, func(r *scaleResult) float64 { return r.total.Seconds() })
	if res["rekey"] != nil && res["upstream"] != nil {
		total.Plots = []Plot{{Chart: "scale", Title: fmt.Sprintf("Key rotation of %s Secrets on one apiserver: time to every Secret under the new key", groupThousands(int64(n))),
			X:      fmt.Sprintf("first edit → all under key2\n(%.0f s vs %.0f s)", res["rekey"].total.Seconds(), res["upstream"].total.Seconds()),
			Series: "rekey's migration (same etcd, same data, same client load)", Against: 1}}
	}
	dbPeak := row("etcd DB size, peak (Maintenance.Status every second)", "MiB", false, func(r *scaleResult) float64 { return mib(r.db.peakSize) })
	inUse := row("etcd DB size in use, peak", "MiB", false, func(r *scaleResult) float64 { return mib(r.db.peakInUse) })
	alarms := row("NOSPACE alarms (AlarmList every second)", "alarms", false, func(r *scaleResult) float64 { return float64(r.db.noSpace) })
	p50b := row("client p50, baseline window", "ms", false, func(r *scaleResult) float64 { return r.baseline.p50 })
	p50d := row("client p50, during the migration", "ms", false, func(r *scaleResult) float64 { return r.during.p50 })
	p99b := row("client p99, baseline window", "ms", false, func(r *scaleResult) float64 { return r.baseline.p99 })
	p99d := row("client p99, during the migration", "ms", false, func(r *scaleResult) float64 { return r.during.p99 })
	if !idle && res["rekey"] != nil && res["upstream"] != nil {
		p99d.Plots = []Plot{{Chart: "scale-clients", Title: fmt.Sprintf("Key rotation of %s Secrets: the cluster's own requests while it runs (client p99)", groupThousands(int64(n))),
			X:      fmt.Sprintf("client p99 during the rewrite\n(baselines %.1f / %.1f ms; during %.1f / %.1f ms)", res["rekey"].baseline.p99, res["upstream"].baseline.p99, res["rekey"].during.p99, res["upstream"].during.p99),
			Series: "rekey's paced migration vs upstream's get | replace", Against: 1}}
	}
	failed := row("client requests failed (baseline + during)", "requests", false, func(r *scaleResult) float64 { return float64(r.baseline.failed + r.during.failed) })
	rssBefore := row("apiserver peak RSS before the rotation (VmHWM: start-up, watch cache, baseline load)", "MiB", false, func(r *scaleResult) float64 { return r.peakRSSBefore })
	rss := row("apiserver peak RSS at the end (VmHWM of the shim that migrates)", "MiB", false, func(r *scaleResult) float64 { return r.peakRSS })
	dbSeeded := row("etcd DB size after seeding", "MiB", false, func(r *scaleResult) float64 { return mib(r.db.firstSize) })
	under := row("stored Secrets under key2 at the end (fresh inventory)", "%", true, func(r *scaleResult) float64 {
		if r.stored == 0 {
			return 0
		}
		return 100 * float64(r.underKey2) / float64(r.stored)
	})
	scaleSideChecks(res, quota, idle, &dbPeak, &alarms, &p99d, &failed, &under)
	if idle {
		return []Row{inventory, throughput, rewriteRate, ceilingWatched, ceilingAlone, offline, total, dbSeeded, dbPeak, inUse, alarms, rssBefore, rss, under}
	}
	return []Row{inventory, throughput, rewriteRate, ceilingWatched, ceilingAlone, offline, total, dbSeeded, dbPeak, inUse, alarms, p50b, p50d, p99b, p99d, failed, rssBefore, rss, under}
}

// scaleSideChecks adds each side's checks to the rows of the etcd DB peak, the
// alarms, the clients' p99 and failures (with a client workload) and the Secrets
// under key2 at the end.
func scaleSideChecks(res map[string]*scaleResult, quota int64, idle bool, dbPeak, alarms, p99d, failed, under *Row) {
	mib := func(v int64) float64 { return float64(v) / (1 << 20) }
	for _, side := range scaleSides {
		r := res[side]
		if r == nil {
			continue
		}
		dbPeak.Checks = append(dbPeak.Checks, Check{Desc: side + ": under the " + quotaText(quota) + " quota", Met: r.db.peakSize < quota,
			Got: fmt.Sprintf("%.0f%% of the quota; %.0f MiB of values seeded", 100*float64(r.db.peakSize)/float64(quota), mib(r.storedBytes))})
		alarms.Checks = append(alarms.Checks, Check{Desc: side + ": 0", Met: r.db.noSpace == 0, Got: fmt.Sprint(r.db.noSpace)})
		if idle {
			continue
		}
		ratio := r.during.p99 / r.baseline.p99
		p99d.Checks = append(p99d.Checks, Check{Desc: side + ": p99 ≤ 1.5× baseline", Met: ratio <= 1.5,
			Got: fmt.Sprintf("×%.2f (%d requests during, %d baseline)", ratio, r.during.requests, r.baseline.requests)})
		failed.Checks = append(failed.Checks, Check{Desc: side + ": 0 failed", Met: r.baseline.failed+r.during.failed == 0,
			Got: fmt.Sprintf("%d of %d", r.baseline.failed+r.during.failed, r.baseline.requests+r.during.requests)})
		under.Checks = append(under.Checks, Check{Desc: side + ": every stored Secret", Met: r.underKey2 == r.stored && r.stored > 0,
			Got: fmt.Sprintf("%d of %d", r.underKey2, r.stored)})
	}
	if u := res["upstream"]; u != nil {
		under.Checks = append(under.Checks, Check{Desc: "upstream's replace", Met: !u.extrapolated,
			Got: fmt.Sprintf("%d replaced, %d conflicts retried", u.rewritten, u.conflicts)})
	}
}

// quotaText is a quota in GiB ("2 GiB") or MiB.
func quotaText(b int64) string {
	if b%(1<<30) == 0 {
		return fmt.Sprintf("%d GiB", b>>30)
	}
	return fmt.Sprintf("%d MiB", b>>20)
}
