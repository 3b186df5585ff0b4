package bench

import (
	"math"
	"sort"
)

// Stats summarises samples of one figure.
type Stats struct {
	Median float64 `json:"median"`
	Min    float64 `json:"min"`
	Max    float64 `json:"max"`
}

// single is the summary of one measurement.
func single(v float64) Stats { return Stats{Median: v, Min: v, Max: v} }

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

// percentile is the nearest-rank p-th percentile of xs (NaN for none).
func percentile(xs []float64, p float64) float64 {
	if len(xs) == 0 {
		return math.NaN()
	}
	s := append([]float64(nil), xs...)
	sort.Float64s(s)
	i := int(math.Ceil(p/100*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

// roundRatios is a[i]/b[i] for each round measured on both sides.
func roundRatios(a, b []float64) []float64 {
	var out []float64
	for i := range min(len(a), len(b)) {
		if b[i] > 0 {
			out = append(out, a[i]/b[i])
		}
	}
	return out
}

// timesBetter is how many times better ours is than base (>1: ours is better): the
// ratio of the two, oriented by whether higher is better. NaN when either is 0.
func timesBetter(ours, base float64, higherIsBetter bool) float64 {
	if ours == 0 || base == 0 {
		return math.NaN()
	}
	if higherIsBetter {
		return ours / base
	}
	return base / ours
}
