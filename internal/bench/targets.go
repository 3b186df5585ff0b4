package bench

import (
	"fmt"
	"strings"
)

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

// evaluate checks row against t.
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
	c.Got = strings.Join(got, ", ")
	return c
}
