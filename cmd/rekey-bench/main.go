// Command rekey-bench measures rekey side by side with upstream k8s.io/apiserver in one
// run and writes a markdown report with charts. `make bench` runs it.
package main

import (
	"bytes"
	"errors"
	"flag"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/rekey-io/rekey/internal/bench"
)

func main() {
	var (
		scenarios  = flag.String("scenarios", "", "comma-separated scenarios to run (default: all); -list shows them")
		list       = flag.Bool("list", false, "list scenarios and exit")
		short      = flag.Bool("short", false, "short mode: fewer sizes, rounds and samples; finishes in under about 2 minutes")
		rounds     = flag.Int("rounds", 0, "alternating samples per implementation and case (default 5, short 3)")
		sampleTime = flag.Duration("sample-time", 0, "target duration of one sample (default 100ms, short 25ms)")
		markdown   = flag.String("markdown", "", "write the report to this file (default: stdout only)")
		charts     = flag.String("charts", "", "write every chart as SVG and PNG into this directory")
		results    = flag.String("results", "", "write the measured results as JSON to this file (-from reads them back)")
		from       = flag.String("from", "", "measure nothing: read results JSON written by -results and render the markdown and charts from it")
		notes      = flag.String("notes", "", "a markdown file inserted at the top of the report (the analysis of what the figures mean)")
		failOnMiss = flag.Bool("fail-on-miss", false, "exit 1 when a target is missed")
		merge      = flag.String("merge", "", "results JSON of an earlier run: keep its scenarios this run does not measure (a missing file keeps nothing)")
		appendix   = flag.String("appendix", "", "a markdown file appended at the end of the report (hand-measured sections)")
		rotObjects = flag.Int("rotation-objects", 0, "Secrets the rotation scenario rotates (default 10,000; short 1,000)")
		rotSides   = flag.String("rotation-sides", "", "comma-separated sides of the rotation scenario to run: rekey, upstream (default both)")
		rotRekey   = flag.String("rotation-rekey-bin", "", "the rekey binary the rotation scenario runs (default: cmd/rekey built from this tree)")
		rotOps     = flag.String("rotation-ops-dir", "", "the rotation scenario: write each side's client requests to DIR/<side>-client-ops.csv (answered at, window, requests, latency)")
		rotShim    = flag.String("rotation-shim-flags", "", "the rotation scenario's rekey side: more flags for its shims, space-separated (e.g. --storage-migration-priority=fast)")
		ctlObjects = flag.Int("controller-objects", 0, "Secrets the controller scenario rotates (default 10,000; short 300)")
		ctlDelays  = flag.String("controller-delays", "", "the controller scenario's projection delay range per hosted apiserver, MIN-MAX as durations (default 0s-60s; short 0s-5s)")
		ctlSeed    = flag.Uint64("controller-seed", 0, "seed of the controller scenario's projection delays (default: from the clock; reported)")
		ctlSides   = flag.String("controller-sides", "", "comma-separated sides of the controller scenario to run: rekey, gardener (default both)")
		scaleN     = flag.Int("scale-objects", 0, "Secrets the scale scenario stores and rotates (default $REKEY_BENCH_SCALE_N, else 1,000,000; short 20,000)")
		scaleSides = flag.String("scale-sides", "", "comma-separated sides of the scale scenario to run: rekey, upstream (default both)")
		scaleBase  = flag.Duration("scale-baseline", 0, "the scale scenario's client-load window before the rotation (default 1m, 5m from 500,000 Secrets; short 10s)")
		scaleRate  = flag.Float64("scale-migration-rate", 0, "the scale scenario's rekey side: the shim's --storage-migration-rate in objects/s (default unlimited)")
		scaleQuota = flag.Int64("scale-quota-bytes", 0, "the scale scenario's etcd --quota-backend-bytes (default 2 GiB)")
		scaleShim  = flag.String("scale-shim-flags", "", "the scale scenario's rekey side: more flags for its shim, space-separated (e.g. -v=2)")
		scaleOps   = flag.String("scale-ops-dir", "", "the scale scenario: write each side's client requests to DIR/<side>-client-ops.csv (start, latency, failed)")
		scaleIdle  = flag.Bool("scale-idle", false, "run the scale scenario without its client workload (the migration on an idle cluster)")
		scaleLimit = flag.Duration("scale-upstream-limit", 0, "time limit of the scale scenario's upstream replace; past it the time is extrapolated from the rate (default 20m)")
	)
	flag.Parse()
	if *list {
		for _, s := range bench.Scenarios() {
			only := ""
			if s.Explicit {
				only = " (only with -scenarios)"
			}
			fmt.Printf("%-14s %s%s\n", s.Name, s.Desc, only)
		}
		return
	}
	settings := bench.Settings{Short: *short, Rounds: 5, SampleTime: 100 * time.Millisecond, Progress: os.Stderr}
	if *short {
		settings.Rounds, settings.SampleTime = 3, 25*time.Millisecond
	}
	if *rounds > 0 {
		settings.Rounds = *rounds
	}
	if *sampleTime > 0 {
		settings.SampleTime = *sampleTime
	}
	settings.RotationObjects, settings.RotationRekeyBin, settings.RotationShimFlags = *rotObjects, *rotRekey, strings.Fields(*rotShim)
	settings.RotationOpsDir = *rotOps
	if *rotSides != "" {
		settings.RotationSides = strings.Split(*rotSides, ",")
	}
	settings.ControllerObjects, settings.ControllerSeed = *ctlObjects, *ctlSeed
	if *ctlDelays != "" {
		lo, hi, err := parseDelayRange(*ctlDelays)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench: -controller-delays:", err)
			os.Exit(2)
		}
		settings.ControllerMinDelay, settings.ControllerMaxDelay = lo, hi
	}
	if *ctlSides != "" {
		settings.ControllerSides = strings.Split(*ctlSides, ",")
	}
	settings.ScaleObjects, settings.ScaleBaseline, settings.ScaleUpstreamLimit, settings.ScaleMigrationRate = *scaleN, *scaleBase, *scaleLimit, *scaleRate
	settings.ScaleQuotaBytes, settings.ScaleIdle, settings.ScaleShimFlags = *scaleQuota, *scaleIdle, strings.Fields(*scaleShim)
	settings.ScaleOpsDir = *scaleOps
	if v := os.Getenv("REKEY_BENCH_SCALE_N"); v != "" && *scaleN == 0 {
		n, err := strconv.Atoi(v)
		if err != nil || n <= 0 {
			fmt.Fprintf(os.Stderr, "rekey-bench: REKEY_BENCH_SCALE_N=%q: want a positive number of Secrets\n", v)
			os.Exit(2)
		}
		settings.ScaleObjects = n
	}
	if *scaleSides != "" {
		settings.ScaleSides = strings.Split(*scaleSides, ",")
	}
	var names []string
	if *scenarios != "" {
		names = strings.Split(*scenarios, ",")
	}
	selected, err := bench.Select(names)
	if err != nil {
		fmt.Fprintln(os.Stderr, "rekey-bench:", err)
		os.Exit(2)
	}
	var report *bench.Report
	if *from != "" {
		var err error
		if report, err = readReport(*from); err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench:", err)
			os.Exit(2)
		}
	} else {
		report = &bench.Report{Command: "rekey-bench " + strings.Join(os.Args[1:], " "), Started: time.Now(), Host: bench.ThisHost()}
		for _, sc := range selected {
			fmt.Fprintf(os.Stderr, "== %s: %s\n", sc.Name, sc.Desc)
			rows, err := sc.Run(settings)
			if err != nil {
				fmt.Fprintf(os.Stderr, "rekey-bench: scenario %s failed: %v\n", sc.Name, err)
				os.Exit(1)
			}
			report.Rows = append(report.Rows, rows...)
		}
		if *merge != "" {
			old, err := readReport(*merge)
			switch {
			case errors.Is(err, fs.ErrNotExist):
				fmt.Fprintf(os.Stderr, "rekey-bench: %s does not exist: nothing to merge\n", *merge)
			case err != nil:
				fmt.Fprintln(os.Stderr, "rekey-bench:", err)
				os.Exit(2)
			default:
				report = report.Merge(old)
			}
		}
	}
	if *results != "" {
		var out bytes.Buffer
		if err := report.WriteJSON(&out); err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench: results:", err)
			os.Exit(1)
		}
		if err := os.WriteFile(*results, out.Bytes(), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench:", err)
			os.Exit(1)
		}
	}
	chartRef := ""
	if *charts != "" {
		if err := report.WriteCharts(*charts); err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench: charts:", err)
			os.Exit(1)
		}
		chartRef = *charts
		if *markdown != "" {
			if rel, err := filepath.Rel(filepath.Dir(*markdown), *charts); err == nil {
				chartRef = rel
			}
		}
	}
	var buf bytes.Buffer
	buf.WriteString("# Benchmarks\n\n")
	if *notes != "" {
		text, err := os.ReadFile(*notes)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench:", err)
			os.Exit(1)
		}
		buf.Write(text)
		buf.WriteString("\n## Results\n\n")
	}
	report.WriteMarkdown(&buf, chartRef)
	if *appendix != "" {
		text, err := os.ReadFile(*appendix)
		if err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench:", err)
			os.Exit(1)
		}
		buf.WriteString("\n")
		buf.Write(text)
	}
	os.Stdout.Write(buf.Bytes())
	if *markdown != "" {
		if err := os.WriteFile(*markdown, buf.Bytes(), 0o644); err != nil {
			fmt.Fprintln(os.Stderr, "rekey-bench:", err)
			os.Exit(1)
		}
	}
	if m := report.Missed(); m > 0 && *from == "" {
		fmt.Fprintf(os.Stderr, "rekey-bench: %d target(s) missed (see the report)\n", m)
		if *failOnMiss {
			os.Exit(1)
		}
	}
}

// parseDelayRange parses "MIN-MAX" of two durations ("0s-60s", "500ms-5s").
func parseDelayRange(v string) (lo, hi time.Duration, err error) {
	a, b, ok := strings.Cut(v, "-")
	if !ok {
		return 0, 0, fmt.Errorf("%q: want MIN-MAX, e.g. 0s-60s", v)
	}
	if lo, err = time.ParseDuration(a); err != nil {
		return 0, 0, err
	}
	if hi, err = time.ParseDuration(b); err != nil {
		return 0, 0, err
	}
	if lo < 0 || hi <= 0 || lo > hi {
		return 0, 0, fmt.Errorf("%q: want 0 <= MIN <= MAX and MAX > 0", v)
	}
	return lo, hi, nil
}

// readReport reads results JSON written by -results.
func readReport(path string) (*bench.Report, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	r, err := bench.ReadReport(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return r, nil
}
