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

// The rotation scenario rotates the local key of 10,000 Secrets on three apiservers
// twice, each time on a fresh testbed, in one run:
//
//   - rekey (rotation_rekey.go): the shims run rekey's layer; `rekey rotate --wait`
//     edits the source file once and follows the cluster until the old key is removed
//     everywhere.
//   - upstream (rotation_upstream.go): the shims run k8s.io/apiserver's layer
//     (--encryption-layer=upstream, its 1-minute file poll untouched) and a script
//     follows upstream's documented procedure: add the key for reads, wait until every
//     apiserver reports the new config hash, promote it, wait, rewrite every Secret
//     through the API, remove the old key, wait.
//
// Both sides edit one source file, which a kubelet-like syncer copies to each
// apiserver's own file after its own random delay (0–10 s, random order), while
// writers update Secrets through every apiserver and a sampler reads every Secret
// through every apiserver (hostedbed.go). This file runs the sides one after the
// other and turns what they measured into rows.
const rotationScenario = "rotation (10,000 Secrets, 3 apiservers, 3-member etcd)"

// RotationSides are the sides the rotation scenario can run.
var rotationSides = []string{"rekey", "upstream"}

// runRotation runs each side on its own fresh testbed, one after the other.
func runRotation(s Settings) ([]Row, error) {
	objects := s.RotationObjects
	if objects <= 0 {
		objects = 10_000
		if s.Short {
			objects = 1_000
		}
	}
	sides := s.RotationSides
	if len(sides) == 0 {
		sides = rotationSides
	}
	if err := checkSides("rotation", sides, rotationSides); err != nil {
		return nil, err
	}
	run, err := startProcessRun(s, "rkr", "rotation: building the shim, etcd and rekey binaries")
	if err != nil {
		return nil, err
	}
	defer run.close()
	ctx, dir, progress, bins := run.ctx, run.dir, run.progress, run.bins
	rekeyBin := s.RotationRekeyBin
	if rekeyBin == "" {
		if rekeyBin, err = testbed.BuildRekey(ctx, filepath.Join(dir, "bin")); err != nil {
			return nil, err
		}
	}
	if slices.Contains(sides, "rekey") {
		// Refuse before minutes of setup, not after.
		if err := checkRotateWait(ctx, rekeyBin); err != nil {
			return nil, err
		}
	}
	results := map[string]*rotationResult{}
	for _, side := range sides {
		fmt.Fprintf(progress, "rotation: side %s, %d Secrets\n", side, objects)
		var shimFlags []string
		if side == "rekey" {
			shimFlags = s.RotationShimFlags
		}
		r, err := rotateOnce(ctx, progress, filepath.Join(dir, side), bins, rekeyBin, side, objects, shimFlags, s.RotationOpsDir)
		if err != nil {
			return nil, fmt.Errorf("rotation side %s: %w", side, err)
		}
		fmt.Fprintf(progress, "rotation: %s: %v from the first edit (%v after the last file update), %d edits; writers: %s; sampler: %s; %d of %d stored Secrets under %s\n",
			side, r.total.Round(time.Millisecond), r.afterLastFile.Round(time.Millisecond), r.edits, r.writes, r.reads, r.underNew, r.stored, r.newKey)
		for _, l := range strings.Split(latencyText(r.clients), "\n") {
			fmt.Fprintf(progress, "rotation: %s: clients: %s\n", side, l)
		}
		results[side] = r
	}
	return rotationRows(results, objects), nil
}

// rotateOnce starts a fresh testbed for side (its shims given shimFlags too), seeds
// objects Secrets under key1, starts the load, rotates with side's procedure and checks
// the end state.
func rotateOnce(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, rekeyBin, side string, objects int, shimFlags []string, opsDir string) (*rotationResult, error) {
	b, err := startRotationBed(ctx, progress, dir, bins, side, objects, shimFlags)
	if err != nil {
		return nil, err
	}
	defer b.stop()

	// The "before" window of the clients' latency (and rekey's pacing baseline).
	select {
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-time.After(rotationBaselineWindow):
	}
	rctx, cancel := context.WithTimeout(ctx, rotationTimeout)
	defer cancel()
	b.clients.enter(windowDuring)
	source := testbed.FollowSource(rctx, b.sourcePath, b.initial, b.syncer)
	res := &rotationResult{side: side}
	var done time.Time
	var final []byte
	var rewrite rewriteTally
	switch side {
	case "rekey":
		done, final, err = rotateRekey(rctx, progress, b, rekeyBin, b.sourcePath)
	case "upstream":
		done, final, rewrite, err = rotateUpstream(rctx, progress, b, b.sourcePath, b.oldKey)
	}
	b.clients.enter("")
	source.Stop()
	res.writes, res.reads = b.stopLoad()
	res.clients = b.clients.summaries()
	res.rewritten, res.rewriteConflicts = rewrite.rewritten, rewrite.conflicts
	res.rewriteTime = b.clients.rewriteTime()
	if opsDir != "" {
		if werr := b.clients.writeOps(filepath.Join(opsDir, side+"-client-ops.csv")); werr != nil {
			fmt.Fprintf(progress, "rotation: %s: writing the clients' requests: %v\n", side, werr)
		}
	}
	if err != nil {
		return nil, fmt.Errorf("%w\n%s", err, b.fleet.LogTails(2000))
	}
	rounds := source.Rounds()
	if len(rounds) == 0 {
		return nil, errors.New("the source file was never edited")
	}
	res.edits = len(rounds)
	first := rounds[0]
	lastFile, err := first.Round.Wait(ctx)
	if err != nil {
		return nil, err
	}
	res.total, res.afterLastFile = done.Sub(first.Detected), done.Sub(lastFile)

	end, err := b.checkEnd(ctx, final)
	if err != nil {
		return nil, err
	}
	res.newKey, res.underNew, res.stored = end.newKey, end.underNew, end.stored
	return res, nil
}

// rotationRows turns the sides' results into rows: rekey first, upstream second, a
// side that did not run noted as such.
func rotationRows(res map[string]*rotationResult, objects int) []Row {
	scenario := rotationScenario
	if objects != 10_000 {
		scenario = strings.Replace(scenario, "10,000", groupThousands(int64(objects)), 1)
	}
	impls := []string{"rekey rotate --wait", "upstream procedure"}
	row := func(c string, unit string, value func(*rotationResult) float64) Row {
		return sidesRow(scenario, c, unit, rotationSides, impls, res, value)
	}
	both := res["rekey"] != nil && res["upstream"] != nil
	plot := func(x string, of func(*rotationResult) time.Duration) []Plot {
		if !both {
			return nil
		}
		// The absolute times under the ratio: a reader sees both.
		x += fmt.Sprintf("\n(%.0f s vs %.0f s)", of(res["rekey"]).Seconds(), of(res["upstream"]).Seconds())
		return []Plot{{Chart: "rotation", Title: fmt.Sprintf("Key rotation of %s Secrets on 3 apiservers: rekey rotate --wait vs upstream's procedure", groupThousands(int64(objects))),
			X: x, Series: "rekey rotate --wait (same testbed, same run)", Against: 1}}
	}
	secs := func(d time.Duration) float64 { return d.Seconds() }

	total := row("first edit → old key removed everywhere", "s", func(r *rotationResult) float64 { return secs(r.total) })
	total.Plots = plot("first edit →\nold key removed", func(r *rotationResult) time.Duration { return r.total })
	if both {
		total.Checks = []Check{evaluate(total, Target{Desc: "≥ 8× faster than upstream (issue 34)", Against: 1, MinSpeedup: 8})}
	}
	after := row("last file update of the first edit → old key removed everywhere", "s", func(r *rotationResult) float64 { return secs(r.afterLastFile) })
	after.Plots = plot("last file update →\nold key removed", func(r *rotationResult) time.Duration { return r.afterLastFile })
	if r := res["rekey"]; r != nil {
		after.Checks = []Check{{Desc: "rekey < 60 s", Met: r.afterLastFile < 60*time.Second, Got: fmt.Sprintf("%.1f s", r.afterLastFile.Seconds())}}
	}
	rewriting := row("the stored Secrets rewritten (rekey: rotate's migrate stage; upstream: the replace of every Secret)", "s",
		func(r *rotationResult) float64 { return secs(r.rewriteTime) })
	if r := res["rekey"]; r != nil {
		bound := maxMigrateStage(objects)
		rewriting.Checks = []Check{{Desc: fmt.Sprintf("rekey ≤ %.0f s for %s Secrets (issue 34)", bound.Seconds(), groupThousands(int64(objects))),
			Met: r.rewriteTime > 0 && r.rewriteTime <= bound, Got: fmt.Sprintf("%.1f s", r.rewriteTime.Seconds())}}
	}
	edits := row("edits of the source file", "edits", func(r *rotationResult) float64 { return float64(r.edits) })
	failed := row("writer requests failed (writers on every apiserver)", "requests", func(r *rotationResult) float64 { return float64(r.writes.Failed()) })
	unreadable := row("unreadable reads (sampler, every Secret through every apiserver)", "reads", func(r *rotationResult) float64 { return float64(r.reads.Total().Unreadable) })
	under := row("stored Secrets under the new key at the end (etcd scan)", "%", func(r *rotationResult) float64 {
		if r.stored == 0 {
			return 0
		}
		return 100 * float64(r.underNew) / float64(r.stored)
	})
	for i := range under.Figures {
		under.Figures[i].HigherIsBetter = true
	}
	for _, side := range rotationSides {
		r := res[side]
		if r == nil {
			continue
		}
		failed.Checks = append(failed.Checks, Check{Desc: side + ": 0 failed", Met: r.writes.Failed() == 0,
			Got: fmt.Sprintf("%d of %d", r.writes.Failed(), r.writes.Failed()+r.writes.Acked())})
		var per []string
		for _, ep := range slices.Sorted(maps.Keys(r.reads.PerEndpoint)) {
			per = append(per, fmt.Sprint(r.reads.PerEndpoint[ep].Unreadable))
		}
		unreadable.Checks = append(unreadable.Checks, Check{Desc: side + ": 0 unreadable", Met: r.reads.Total().Unreadable == 0,
			Got: fmt.Sprintf("per apiserver %s; %d reads in all", strings.Join(per, " / "), r.reads.Total().Reads)})
		under.Checks = append(under.Checks, Check{Desc: side + ": every stored Secret", Met: r.underNew == r.stored && r.stored > 0,
			Got: fmt.Sprintf("%d of %d", r.underNew, r.stored)})
	}
	if r := res["upstream"]; r != nil {
		under.Checks = append(under.Checks, Check{Desc: "upstream's rewrite", Met: true,
			Got: fmt.Sprintf("%d no-op updates, %d conflicts retried", r.rewritten, r.rewriteConflicts)})
	}
	return append([]Row{total, after, rewriting, edits, failed, unreadable, under}, clientLatencyRows(res, rotationSides, row)...)
}

// maxMigrateStage is issue 34's bound on rekey's migrate stage: 5 s for 10,000
// Secrets, in proportion for another count (at least a second).
func maxMigrateStage(objects int) time.Duration {
	return max(time.Second, time.Duration(objects)*5*time.Second/10_000)
}

// startRotationBed starts a fresh testbed in dir whose shims run layer side with
// shimFlags, seeds objects Secrets under a new key key1 and starts the writers and the
// sampler.
func startRotationBed(ctx context.Context, progress io.Writer, dir string, bins testbed.Binaries, side string, objects int, shimFlags []string) (b *hostedBed, err error) {
	return startHostedBed(ctx, progress, dir, bins, hostedBedConfig{scenario: "rotation", side: side, layer: side, objects: objects, shimFlags: shimFlags})
}
