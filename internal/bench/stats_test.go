package bench

import (
	"math"
	"slices"
	"testing"
)

func TestSummarize(t *testing.T) {
	for _, c := range []struct {
		xs   []float64
		want Stats
	}{
		{nil, Stats{}},
		{[]float64{4}, Stats{Median: 4, Min: 4, Max: 4}},
		{[]float64{9, 1, 5}, Stats{Median: 5, Min: 1, Max: 9}},
		// An even count's median is the mean of the middle two.
		{[]float64{8, 2, 4, 6}, Stats{Median: 5, Min: 2, Max: 8}},
	} {
		in := slices.Clone(c.xs)
		if got := summarize(in); got != c.want {
			t.Errorf("summarize(%v) = %+v, want %+v", c.xs, got, c.want)
		}
		if !slices.Equal(in, c.xs) {
			t.Errorf("summarize sorted its input in place: %v", in)
		}
	}
	if got := single(2.5); got != (Stats{Median: 2.5, Min: 2.5, Max: 2.5}) {
		t.Errorf("single(2.5) = %+v", got)
	}
}

// Nearest rank: the p-th percentile is a sample, the smallest one with at least p% of
// the samples at or below it.
func TestPercentile(t *testing.T) {
	xs := []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}
	for p, want := range map[float64]float64{0: 1, 10: 1, 11: 2, 25: 3, 50: 5, 75: 8, 99: 10, 100: 10} {
		if got := percentile(xs, p); got != want {
			t.Errorf("percentile(1..10, %v) = %v, want %v", p, got, want)
		}
	}
	if got := percentile(nil, 50); !math.IsNaN(got) {
		t.Errorf("percentile of no samples = %v, want NaN", got)
	}
	if !slices.Equal(xs, []float64{10, 1, 9, 2, 8, 3, 7, 4, 6, 5}) {
		t.Errorf("percentile sorted its input in place: %v", xs)
	}
}

// A round missing on one side, or with a zero baseline, gives no ratio.
func TestRoundRatios(t *testing.T) {
	got := roundRatios([]float64{10, 30, 5, 7}, []float64{5, 0, 10})
	if want := []float64{2, 0.5}; !slices.Equal(got, want) {
		t.Fatalf("roundRatios = %v, want %v", got, want)
	}
}

func TestTimesBetter(t *testing.T) {
	for _, c := range []struct {
		ours, base float64
		higher     bool
		want       float64
	}{
		{10, 40, false, 4},    // a quarter of the time: 4× better
		{40, 10, false, 0.25}, // four times the time
		{40, 10, true, 4},     // four times the throughput
	} {
		if got := timesBetter(c.ours, c.base, c.higher); got != c.want {
			t.Errorf("timesBetter(%v, %v, %v) = %v, want %v", c.ours, c.base, c.higher, got, c.want)
		}
	}
	for _, c := range [][2]float64{{0, 5}, {5, 0}} {
		if got := timesBetter(c[0], c[1], false); !math.IsNaN(got) {
			t.Errorf("timesBetter(%v, %v) = %v, want NaN", c[0], c[1], got)
		}
	}
}
