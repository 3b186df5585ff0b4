// Package bench is the side-by-side benchmark harness behind `rekey-bench` and
// `make bench`: every scenario measures rekey and a baseline (upstream k8s.io/apiserver,
// or raw AES-GCM) in the same process and run, alternating, and reports medians, spread
// and ratios against the targets the issues set. A missed target is printed as missed.
package bench

import (
	"runtime"
	"sort"
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

// Stats summarises samples of one figure.
type Stats struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

func summarize(xs []float64) Stats {
	if len(xs) == 0 {
		return Stats{}
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	mid := len(s) / 2
	med := s[mid]
	if len(s)%2 == 0 {
		med = (s[mid-1] + s[mid]) / 2
	}
	return Stats{Median: med, Min: s[0], Max: s[len(s)-1]}
}
