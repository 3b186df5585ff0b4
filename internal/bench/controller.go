package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"maps"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The controller scenario measures issue 31's promise: a key rotation declared on a
// ControlPlaneEncryption object, with the configuration in a Secret that reaches each
// hosted apiserver late, against a Gardener-style procedure on the same testbed, in
// one run. Each side gets a fresh testbed (3-member etcd, three shims, N Secrets under
// key1, writers and a sampler, as the rotation scenario's); both share one management
// API (dist/kube-apiserver with the CRD, controller_mgmt.go) holding each side's
// configuration Secret, which the testbed's projector (testbed.FollowSecret) copies into
// each shim's directory with the kubelet's atomic-writer layout, each copy after its own
// random delay (seeded; both sides use the same seed, so their first edits' delays are
// the same).
//
//   - rekey: the shims run rekey's layer; `rekey controller` watches the object, and
//     rotationGeneration raised from 0 to 1 is timed until the status says Completed
//     (condition EtcdDataEncryptionUpToDate True). No apiserver is restarted.
//   - gardener: the shims run k8s.io/apiserver's layer without automatic reload
//     (kube-apiserver's default, as Gardener runs it) and a script does what Gardener
//     does: the same Secret edits in phases, each followed, once projected everywhere,
//     by a rolling restart of the apiservers (one at a time: out of the load balancer,
//     SIGTERM, start, ready, back in): key2 added for reads; key2 made the write key;
//     then every Secret rewritten through the API (a `kubectl replace` of each); then
//     key1 dropped. Timed from the first edit to the last apiserver ready again.
//
// Both report time, apiserver restarts, failed client requests, unreadable reads,
// what every stored Secret is under at the end, and the clients' p50/p99.

// controllerSides are the sides the controller scenario can run.
var controllerSides = []string{"rekey", "gardener"}

// controllerResult is what one side measured.
type controllerResult struct {
	rotationResult
	// restarts are apiserver processes started again during the run (the procedure's
	// and any other: a shim whose process changed counts).
	restarts int
	// excused are writes that failed on an apiserver taken out of the load balancer
	// while they were in flight (a restart). (The sampler reads through every
	// apiserver, in the load balancer or not: its failures on one that is out are
	// downtime, which outOfLB measures.)
	excused int64
	// outOfLB is how long apiservers were out of the load balancer for restarts,
	// summed over them.
	outOfLB time.Duration
	// delays are each projection's per-apiserver delays, in edit order.
	delays [][]time.Duration
	// steps are the procedure's steps with when each ended, from the start.
	steps []controllerStep
}

// controllerStep is one step of a side's procedure and when it ended.
type controllerStep struct {
	what string
	at   time.Duration
}

// controllerConfig is one run's parameters.
type controllerConfig struct {
	objects            int
	minDelay, maxDelay time.Duration
	// baseline is the load's window before the rotation: rotationBaselineWindow, 5 s
	// in short mode (enough requests for rekey's pacing baseline).
	baseline time.Duration
	seed     uint64
}

// runController runs each side on its own fresh testbed, one after the other, against
// one management API.
func runController(s Settings) ([]Row, error) {
	cfg := controllerConfig{objects: s.ControllerObjects, minDelay: s.ControllerMinDelay, maxDelay: s.ControllerMaxDelay, seed: s.ControllerSeed,
		baseline: rotationBaselineWindow}
	if s.Short {
		cfg.baseline = 5 * time.Second
	}
	if cfg.objects <= 0 {
		cfg.objects = 10_000
		if s.Short {
			cfg.objects = 300
		}
	}
	if cfg.maxDelay <= 0 {
		cfg.maxDelay = 60 * time.Second
		if s.Short {
			cfg.maxDelay = 5 * time.Second
		}
	}
	if cfg.minDelay < 0 || cfg.minDelay > cfg.maxDelay {
		return nil, fmt.Errorf("controller: projection delays %v–%v: an empty range", cfg.minDelay, cfg.maxDelay)
	}
	if cfg.seed == 0 {
		cfg.seed = uint64(time.Now().UnixNano())
	}
	sides := s.ControllerSides
	if len(sides) == 0 {
		sides = controllerSides
	}
	if err := checkSides("controller", sides, controllerSides); err != nil {
		return nil, err
	}
	run, err := startProcessRun(s, "rkc", "controller: building the shim, etcd and rekey binaries")
	if err != nil {
		return nil, err
	}
	defer run.close()
	ctx, dir, progress, bins := run.ctx, run.dir, run.progress, run.bins
	// dist/kube-apiserver links while cmd/rekey builds.
	type built struct {
		bin string
		err error
	}
	kapiBuilt := make(chan built, 1)
	go func() {
		start := time.Now()
		kapi, err := testbed.BuildKubeAPIServer(ctx, filepath.Join(dir, "bin"), false)
		fmt.Fprintf(progress, "controller: dist/kube-apiserver built in %v\n", time.Since(start).Round(time.Millisecond))
		kapiBuilt <- built{kapi.Rekey, err}
	}()
	rekeyBin, err := testbed.BuildRekey(ctx, filepath.Join(dir, "bin"))
	kapi := <-kapiBuilt
	if err != nil {
		return nil, err
	}
	if kapi.err != nil {
		return nil, kapi.err
	}
	mgmt, err := startMgmtAPI(ctx, progress, dir, bins, kapi.bin)
	if err != nil {
		return nil, err
	}
	defer mgmt.stop()
	fmt.Fprintf(progress, "controller: %d Secrets, projection delays %v–%v, seed %d (-controller-seed replays them)\n", cfg.objects, cfg.minDelay, cfg.maxDelay, cfg.seed)
	results := map[string]*controllerResult{}
	for _, side := range sides {
		fmt.Fprintf(progress, "controller: side %s, %d Secrets\n", side, cfg.objects)
		r, err := controllerOnce(ctx, progress, filepath.Join(dir, side), bins, mgmt, rekeyBin, side, cfg)
		if err != nil {
			return nil, fmt.Errorf("controller side %s: %w", side, err)
		}
		fmt.Fprintf(progress, "controller: %s: %v, %d edits, %d apiserver restarts, slowest projection per edit %s; writers: %s; sampler: %s; %d of %d stored Secrets under %s\n",
			side, r.total.Round(time.Millisecond), r.edits, r.restarts, slowestText(r.delays), r.writes, r.reads, r.underNew, r.stored, r.newKey)
		for _, l := range strings.Split(latencyText(r.clients), "\n") {
			fmt.Fprintf(progress, "controller: %s: clients: %s\n", side, l)
		}
		for _, e := range append(slices.Clone(r.writes.Errors), r.reads.Examples...) {
			fmt.Fprintf(progress, "controller: %s: failed: %s\n", side, e)
		}
		results[side] = r
	}
	return controllerRows(results, cfg), nil
}

// controllerOnce starts a fresh testbed for side, its configuration Secret in the
// management API projected into the shims' files, runs side's procedure and checks
// the end state.
func controllerOnce(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, mgmt *mgmtAPI, rekeyBin, side string, cfg controllerConfig) (*controllerResult, error) {
	layer, flags := "rekey", []string(nil)
	if side == "gardener" {
		layer, flags = "upstream", []string{"--encryption-provider-config-automatic-reload=false"}
	}
	b, err := startHostedBed(ctx, progress, dir, bins, hostedBedConfig{scenario: "controller", side: side, layer: layer,
		objects: cfg.objects, shimFlags: flags, minDelay: cfg.minDelay, maxDelay: cfg.maxDelay, seed: cfg.seed})
	if err != nil {
		return nil, err
	}
	defer b.stop()
	secret := "kas-encryption-" + side
	if err := mgmt.createConfigSecret(ctx, secret, b.initial); err != nil {
		return nil, err
	}
	pids := shimPIDs(b.fleet)
	var ctrl *testbed.Process
	if side == "rekey" {
		if ctrl, err = startRekeyController(ctx, progress, dir, mgmt, rekeyBin, b, secret); err != nil {
			return nil, err
		}
		defer ctrl.Stop(10 * time.Second)
	}
	// The "before" window of the clients' latency (and rekey's pacing baseline).
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(cfg.baseline):
	}
	rctx, cancel := context.WithTimeout(ctx, rotationTimeout)
	defer cancel()
	b.clients.enter(windowDuring)
	follow := testbed.FollowSecret(rctx, mgmt.kube.CoreV1(), mgmtNamespace, secret, mgmtConfigKey, b.initial, b.syncer)
	res := &controllerResult{rotationResult: rotationResult{side: side}}
	start := time.Now()
	var done time.Time
	var final []byte
	var rewrite rewriteTally
	switch side {
	case "rekey":
		done, final, res.steps, err = rotateByController(rctx, progress, mgmt, b, start)
	case "gardener":
		var g gardenerRun
		done, final, g, err = rotateGardenerStyle(rctx, progress, mgmt, b, follow, secret, start)
		res.steps, res.restarts, res.outOfLB, rewrite = g.steps, g.restarts, g.outOfLB, g.rewrite
	}
	b.clients.enter("")
	follow.Stop()
	res.writes, res.reads = b.stopLoad()
	res.clients = b.clients.summaries()
	res.rewritten, res.rewriteConflicts = rewrite.rewritten, rewrite.conflicts
	if err != nil {
		tail := b.fleet.LogTails(2000)
		if ctrl != nil {
			tail += "--- rekey controller:\n" + ctrl.Log(4000)
		}
		return nil, fmt.Errorf("%w\n%s", err, tail)
	}
	if side == "rekey" {
		// Restarts nobody asked for (a crash, a supervisor) count too.
		res.restarts += changedPIDs(pids, shimPIDs(b.fleet))
	}
	rounds := follow.Rounds()
	if len(rounds) == 0 {
		return nil, errors.New("the configuration Secret was never edited")
	}
	res.edits = len(rounds)
	for _, r := range rounds {
		if _, err := r.Round.Wait(ctx); err != nil {
			return nil, err
		}
		res.delays = append(res.delays, slices.Clone(r.Round.Delays))
	}
	res.total = done.Sub(start)
	for _, c := range res.writes.PerEndpoint {
		res.excused += c.Excused
	}
	end, err := b.checkEnd(ctx, final)
	if err != nil {
		return nil, err
	}
	res.newKey, res.underNew, res.stored = end.newKey, end.underNew, end.stored
	return res, nil
}

// shimPIDs are the fleet's current process ids, by shim.
func shimPIDs(f *testbed.Fleet) map[string]int {
	out := map[string]int{}
	for _, s := range f.Shims {
		if sh := s.Current(); sh != nil {
			out[s.ID] = sh.PID()
		}
	}
	return out
}

// changedPIDs counts the shims whose process is not the one of before.
func changedPIDs(before, after map[string]int) (n int) {
	for id, pid := range after {
		if before[id] != pid {
			n++
		}
	}
	return n
}

// slowest is the largest of a projection's delays (a skipped copy is -1).
func slowest(ds []time.Duration) time.Duration {
	var m time.Duration
	for _, d := range ds {
		m = max(m, d)
	}
	return m
}

// slowestSum is the sum of every projection's slowest delay.
func slowestSum(delays [][]time.Duration) (sum time.Duration) {
	for _, ds := range delays {
		sum += slowest(ds)
	}
	return sum
}

// slowestText is "12.3 s + 45.6 s" (each projection's slowest delay).
func slowestText(delays [][]time.Duration) string {
	var parts []string
	for _, ds := range delays {
		parts = append(parts, fmt.Sprintf("%.1f s", slowest(ds).Seconds()))
	}
	return strings.Join(parts, " + ")
}

// delaysText is every projection's per-apiserver delays: "[3.1 44.0 12.9] [..]" s.
func delaysText(delays [][]time.Duration) string {
	var parts []string
	for _, ds := range delays {
		var each []string
		for _, d := range ds {
			each = append(each, fmt.Sprintf("%.1f", d.Seconds()))
		}
		parts = append(parts, "["+strings.Join(each, " ")+"]")
	}
	return strings.Join(parts, " ") + " s"
}

// stepsText is "edit +0.4 s, promote +41.2 s, ...".
func stepsText(steps []controllerStep) string {
	var parts []string
	for _, s := range steps {
		parts = append(parts, fmt.Sprintf("%s +%.1f s", s.what, s.at.Seconds()))
	}
	return strings.Join(parts, ", ")
}

// controllerGoalSlack is issue 31's goal's margin over the projection: trigger →
// Completed within the slowest replica's delay + 10 s.
const controllerGoalSlack = 10 * time.Second

// controllerScenario names the scenario for a run's parameters.
func controllerScenario(cfg controllerConfig) string {
	return fmt.Sprintf("controller (%s Secrets, 3 hosted apiservers, 3-member etcd, projection delays %s)",
		groupThousands(int64(cfg.objects)), delayRangeText(cfg.minDelay, cfg.maxDelay))
}

// delayRangeText is a delay range in seconds: "0–60 s", "0.5–5 s".
func delayRangeText(lo, hi time.Duration) string {
	n := func(d time.Duration) string {
		return strings.TrimSuffix(strings.TrimRight(fmt.Sprintf("%.1f", d.Seconds()), "0"), ".")
	}
	return n(lo) + "–" + n(hi) + " s"
}

// controllerRows turns the sides' results into rows: rekey first, Gardener-style
// second, a side that did not run noted as such.
func controllerRows(res map[string]*controllerResult, cfg controllerConfig) []Row {
	scenario := controllerScenario(cfg)
	impls := []string{"rekey controller", "Gardener-style"}
	row := func(c string, unit string, value func(*controllerResult) float64) Row {
		return sidesRow(scenario, c, unit, controllerSides, impls, res, value)
	}
	both := res["rekey"] != nil && res["gardener"] != nil
	secs := func(d time.Duration) float64 { return d.Seconds() }

	total := row("trigger → Completed (rekey) / first edit → last apiserver restarted (Gardener-style)", "s", func(r *controllerResult) float64 { return secs(r.total) })
	if both {
		total.Plots = []Plot{{Chart: "controller", Title: fmt.Sprintf("Rotation declared on an object, %s Secrets, projection delays %s: rekey controller vs a Gardener-style procedure",
			groupThousands(int64(cfg.objects)), delayRangeText(cfg.minDelay, cfg.maxDelay)),
			X:      fmt.Sprintf("trigger → Completed\n(%.0f s vs %.0f s)", res["rekey"].total.Seconds(), res["gardener"].total.Seconds()),
			Series: "rekey controller (same testbed, same run)", Against: 1}}
	}
	if r := res["rekey"]; r != nil {
		goal := slowestSum(r.delays) + controllerGoalSlack
		first := time.Duration(0)
		if len(r.delays) > 0 {
			first = slowest(r.delays[0]) + controllerGoalSlack
		}
		total.Checks = append(total.Checks, Check{Desc: fmt.Sprintf("rekey ≤ the slowest replica's delay of each of its %d projections + 10 s", len(r.delays)),
			Met: r.total <= goal, Got: fmt.Sprintf("%.1f s against %.1f s (%s + 10 s); of the first projection alone + 10 s: %.1f s",
				r.total.Seconds(), goal.Seconds(), slowestText(r.delays), first.Seconds())})
	}
	for _, side := range controllerSides {
		if r := res[side]; r != nil {
			total.Checks = append(total.Checks, Check{Desc: side + "'s steps", Met: true, Got: stepsText(r.steps)})
		}
	}
	delays := row("slowest replica's projection delay, summed over the Secret's edits", "s", func(r *controllerResult) float64 { return secs(slowestSum(r.delays)) })
	for _, side := range controllerSides {
		if r := res[side]; r != nil {
			delays.Checks = append(delays.Checks, Check{Desc: side + "'s delays per edit and apiserver", Met: true,
				Got: fmt.Sprintf("%s (seed %d)", delaysText(r.delays), cfg.seed)})
		}
	}
	edits := row("edits of the configuration Secret", "edits", func(r *controllerResult) float64 { return float64(r.edits) })
	restarts := row("apiserver restarts", "restarts", func(r *controllerResult) float64 { return float64(r.restarts) })
	if r := res["rekey"]; r != nil {
		restarts.Checks = []Check{{Desc: "rekey: 0 restarts", Met: r.restarts == 0, Got: fmt.Sprint(r.restarts)}}
	}
	failed := row("client requests failed on an apiserver in the load balancer (writers' failures + sampler's unreadable, missing, stale and failed reads)", "requests", func(r *controllerResult) float64 {
		return float64(r.writes.Failed() + r.reads.Total().Bad())
	})
	excused := row("writes cut by a restart (in flight on an apiserver taken out of the load balancer)", "requests", func(r *controllerResult) float64 { return float64(r.excused) })
	outOfLB := row("apiserver time out of the load balancer for restarts, summed", "s", func(r *controllerResult) float64 { return secs(r.outOfLB) })
	unreadable := row("unreadable reads (sampler, every Secret through every apiserver)", "reads", func(r *controllerResult) float64 { return float64(r.reads.Total().Unreadable) })
	under := row("stored Secrets under the new key at the end (etcd scan)", "%", func(r *controllerResult) float64 {
		if r.stored == 0 {
			return 0
		}
		return 100 * float64(r.underNew) / float64(r.stored)
	})
	for i := range under.Figures {
		under.Figures[i].HigherIsBetter = true
	}
	for _, side := range controllerSides {
		r := res[side]
		if r == nil {
			continue
		}
		t := r.reads.Total()
		failed.Checks = append(failed.Checks, Check{Desc: side + ": 0 failed", Met: r.writes.Failed()+t.Bad() == 0,
			Got: fmt.Sprintf("writes %d of %d; reads %d unreadable, %d missing, %d stale, %d errors of %d", r.writes.Failed(), r.writes.Failed()+r.writes.Acked(),
				t.Unreadable, t.Missing, t.Stale, t.Errors, t.Reads)})
		var per []string
		for _, ep := range slices.Sorted(maps.Keys(r.reads.PerEndpoint)) {
			per = append(per, fmt.Sprint(r.reads.PerEndpoint[ep].Unreadable))
		}
		unreadable.Checks = append(unreadable.Checks, Check{Desc: side + ": 0 unreadable", Met: t.Unreadable == 0,
			Got: fmt.Sprintf("per apiserver %s; %d reads in all", strings.Join(per, " / "), t.Reads)})
		under.Checks = append(under.Checks, Check{Desc: side + ": every stored Secret", Met: r.underNew == r.stored && r.stored > 0,
			Got: fmt.Sprintf("%d of %d", r.underNew, r.stored)})
	}
	if r := res["gardener"]; r != nil {
		under.Checks = append(under.Checks, Check{Desc: "Gardener-style rewrite", Met: true,
			Got: fmt.Sprintf("%d no-op updates, %d conflicts retried", r.rewritten, r.rewriteConflicts)})
	}
	// The clients' latency rows are the rotation scenario's, on these sides.
	asRotation := map[string]*rotationResult{}
	for side, r := range res {
		asRotation[side] = &r.rotationResult
	}
	byRotation := func(c, unit string, value func(*rotationResult) float64) Row {
		return row(c, unit, func(r *controllerResult) float64 { return value(&r.rotationResult) })
	}
	return append([]Row{total, delays, edits, restarts, outOfLB, failed, excused, unreadable, under}, clientLatencyRows(asRotation, controllerSides, byRotation)...)
}
