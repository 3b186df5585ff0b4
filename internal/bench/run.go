package bench

import (
	"fmt"
	"io"
	"runtime"
	"time"
)

// Settings control a whole harness run.
type Settings struct {
	// Short finishes the whole run in under about two minutes.
	Short bool
	// Rounds is how many alternating samples each implementation gets per case.
	Rounds int
	// SampleTime is the target duration of one sample.
	SampleTime time.Duration
	// Progress receives one line per finished case (nil: silent).
	Progress io.Writer
	// RotationObjects is the number of Secrets the rotation scenario rotates (default
	// 10,000; 1,000 in short mode).
	RotationObjects int
	// RotationSides are the rotation scenario's sides to run: rekey, upstream (default
	// both).
	RotationSides []string
	// RotationRekeyBin is the rekey binary side (a) runs (default: cmd/rekey built from
	// this tree).
	RotationRekeyBin string
}

// Impl is one implementation of an operation.
type Impl struct {
	Name string
	Op   Op
	// Reset, when set, runs (untimed) before every sample: implementations that retain
	// memory per operation get a fresh instance, so their heap does not tax the others'
	// garbage collection in the shared process.
	Reset func() error
}

// "Never slower" targets allow this much noise: where both sides do the same work (the
// cipher and one output allocation dominate at 1 MiB), medians of alternating samples on
// this shared machine still differ by a few percent either way.
const (
	noiseFloor = 0.95
	noSlower   = "never slower than upstream (5% noise margin)"
)

// Target is a goal for rekey (Impls[0]) in one case.
type Target struct {
	Desc string
	// Against is the index of the baseline implementation for MinSpeedup.
	Against    int
	MinSpeedup float64
	// MaxAllocs bounds rekey's allocations per op when > 0.
	MaxAllocs float64
}

// OpCase is one row measured by timing operations.
type OpCase struct {
	Scenario, Case, Chart, X string
	// Plots places the row on charts (see Row.Plots).
	Plots    []Plot
	Impls    []Impl
	Parallel bool
	Targets  []Target
}

// RunOpCases measures every case, alternating implementations within each round and
// rotating which one goes first, so drift on a noisy machine hits all of them alike.
func RunOpCases(s Settings, cases []OpCase) ([]Row, error) {
	var rows []Row
	for ci, c := range cases {
		samples := make([][]Sample, len(c.Impls))
		for r := 0; r < s.Rounds; r++ {
			for k := range c.Impls {
				i := (k + r) % len(c.Impls)
				if reset := c.Impls[i].Reset; reset != nil {
					if err := reset(); err != nil {
						return nil, fmt.Errorf("%s %s (%s): reset: %w", c.Scenario, c.Case, c.Impls[i].Name, err)
					}
				}
				smp, err := measure(c.Impls[i].Op, Budget{SampleTime: s.SampleTime, Parallel: c.Parallel})
				if err != nil {
					return nil, fmt.Errorf("%s %s (%s): %w", c.Scenario, c.Case, c.Impls[i].Name, err)
				}
				samples[i] = append(samples[i], smp)
			}
		}
		row := Row{Scenario: c.Scenario, Case: c.Case, Chart: c.Chart, X: c.X, Plots: c.Plots}
		for i, im := range c.Impls {
			var ns, allocs, bytes []float64
			for _, smp := range samples[i] {
				ns = append(ns, smp.NsPerOp)
				allocs = append(allocs, smp.AllocsPerOp)
				bytes = append(bytes, smp.BytesPerOp)
			}
			row.Figures = append(row.Figures, Figure{
				Impl: im.Name, Unit: "ns/op", Stats: summarize(ns),
				Allocs: summarize(allocs).Median, Bytes: summarize(bytes).Median, Retained: -1,
			})
		}
		for _, t := range c.Targets {
			row.Checks = append(row.Checks, evaluate(row, t))
		}
		rows = append(rows, row)
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "[%d/%d] %s %s: %s", ci+1, len(cases), c.Scenario, c.Case, fmtStat(row.Figures[0]))
			for i := 1; i < len(row.Figures); i++ {
				fmt.Fprintf(s.Progress, "  ×%.2f vs %s", row.Speedup(i), row.Figures[i].Impl)
			}
			fmt.Fprintln(s.Progress)
		}
	}
	return rows, nil
}

func evaluate(row Row, t Target) Check {
	c := Check{Desc: t.Desc, Met: true}
	var got []string
	if t.MinSpeedup > 0 {
		sp := row.Speedup(t.Against)
		got = append(got, fmt.Sprintf("×%.2f", sp))
		if !(sp >= t.MinSpeedup) {
			c.Met = false
		}
	}
	if t.MaxAllocs > 0 {
		a := row.Figures[0].Allocs
		got = append(got, fmt.Sprintf("%.1f allocs", a))
		if a > t.MaxAllocs+0.05 { // tolerate GC-internal noise in MemStats
			c.Met = false
		}
	}
	c.Got = joinComma(got)
	return c
}

func joinComma(xs []string) string {
	out := ""
	for i, x := range xs {
		if i > 0 {
			out += ", "
		}
		out += x
	}
	return out
}

// RetainedHeap runs op n times and returns how much the live heap grew, after a GC,
// while keep (the object under test) is still reachable.
func RetainedHeap(n int, op Op, keep any) (float64, error) {
	var before, after runtime.MemStats
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&before)
	for i := 0; i < n; i++ {
		if err := op(); err != nil {
			return 0, err
		}
	}
	runtime.GC()
	runtime.GC()
	runtime.ReadMemStats(&after)
	runtime.KeepAlive(keep)
	return float64(int64(after.HeapAlloc) - int64(before.HeapAlloc)), nil
}
