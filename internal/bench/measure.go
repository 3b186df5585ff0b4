package bench

import (
	"fmt"
	"runtime"
	"sync"
	"time"
)

// Sample is one timed batch of operations.
type Sample struct {
	NsPerOp     float64
	AllocsPerOp float64
	BytesPerOp  float64
}

// Op is one operation under test; it reports failure by returning an error.
type Op func() error

// Budget bounds how long one sample runs.
type Budget struct {
	// SampleTime is the target wall time of one sample.
	SampleTime time.Duration
	// Parallel runs the op on GOMAXPROCS goroutines.
	Parallel bool
}

// measure runs op repeatedly for about budget.SampleTime and returns per-op figures.
// The batch size is calibrated first (as testing.B does), so tiny ops are not dominated
// by the timer.
func measure(op Op, budget Budget) (Sample, error) {
	n := 1
	var elapsed time.Duration
	for {
		d, err := runBatch(op, n, budget.Parallel)
		if err != nil {
			return Sample{}, err
		}
		elapsed = d
		if d >= budget.SampleTime/4 || n >= 1<<30 {
			break
		}
		// Aim for the full sample time with the observed rate, growing at most 100×.
		next := n * 100
		if d > 0 {
			if est := int(float64(n) * float64(budget.SampleTime) / float64(d)); est < next {
				next = est
			}
		}
		if next <= n {
			next = n + 1
		}
		n = next
	}
	_ = elapsed
	var before, after runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&before)
	d, err := runBatch(op, n, budget.Parallel)
	if err != nil {
		return Sample{}, err
	}
	runtime.ReadMemStats(&after)
	return Sample{
		NsPerOp:     float64(d.Nanoseconds()) / float64(n),
		AllocsPerOp: float64(after.Mallocs-before.Mallocs) / float64(n),
		BytesPerOp:  float64(after.TotalAlloc-before.TotalAlloc) / float64(n),
	}, nil
}

func runBatch(op Op, n int, parallel bool) (time.Duration, error) {
	if !parallel {
		start := time.Now()
		for i := 0; i < n; i++ {
			if err := op(); err != nil {
				return 0, err
			}
		}
		return time.Since(start), nil
	}
	workers := runtime.GOMAXPROCS(0)
	var wg sync.WaitGroup
	var firstErr error
	var mu sync.Mutex
	start := time.Now()
	for w := 0; w < workers; w++ {
		count := n / workers
		if w < n%workers {
			count++
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			for i := 0; i < count; i++ {
				if err := op(); err != nil {
					mu.Lock()
					if firstErr == nil {
						firstErr = err
					}
					mu.Unlock()
					return
				}
			}
		}()
	}
	wg.Wait()
	return time.Since(start), firstErr
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
