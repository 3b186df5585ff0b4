package bench

// Figure is one implementation's result in one row.
type Figure struct {
	Impl  string `json:"impl"`
	Unit  string `json:"unit"` // "ns/op", "ms", "ops/s", ...
	Stats Stats  `json:"stats"`
	// HigherIsBetter is true for throughputs.
	HigherIsBetter bool `json:"higherIsBetter,omitempty"`
	// Allocs and Bytes are per-op medians; negative when not measured.
	Allocs float64 `json:"allocsPerOp"`
	Bytes  float64 `json:"bytesPerOp"`
	// Retained is heap bytes still live after the run, when measured (else negative).
	Retained float64 `json:"retainedBytes"`
	// Note replaces the figure in the table (e.g. "not run in short mode").
	Note string `json:"note,omitempty"`
}

// wholeRunFigure is a figure measured over a whole run rather than per op: no
// allocation or heap figures.
func wholeRunFigure(impl, unit string, st Stats, higherIsBetter bool) Figure {
	return Figure{Impl: impl, Unit: unit, Stats: st, HigherIsBetter: higherIsBetter, Allocs: -1, Bytes: -1, Retained: -1}
}

// Check is one target verdict.
type Check struct {
	Desc string `json:"desc"`
	Met  bool   `json:"met"`
	Got  string `json:"got"`
}

// Row is one case of a scenario: the first figure is rekey's.
type Row struct {
	Scenario string `json:"scenario"`
	Case     string `json:"case"`
	// Chart groups rows into one chart with one series per baseline; X is the row's
	// label on it. Plots says more precisely where the row is drawn; a row may use
	// either or both.
	Chart   string   `json:"chart,omitempty"`
	X       string   `json:"x,omitempty"`
	Plots   []Plot   `json:"plots,omitempty"`
	Figures []Figure `json:"figures"`
	Checks  []Check  `json:"checks,omitempty"`
}

// Speedup of the first figure over figure i (>1 means rekey is better).
func (r Row) Speedup(i int) float64 {
	ours, base := r.Figures[0], r.Figures[i]
	return timesBetter(ours.Stats.Median, base.Stats.Median, ours.HigherIsBetter)
}

// Plot places one row's ratio on one chart: the bar for Series in the group X of the
// chart Chart shows how many times better rekey (the row's first figure) is than the
// figure at index Against. A scenario says where its rows go; chart.go draws them.
type Plot struct {
	// Chart names the chart and its file (lower case, digits and dashes).
	Chart string `json:"chart"`
	// Title is the chart's title; the first non-empty one of a chart wins.
	Title string `json:"title,omitempty"`
	// X is the group label on the x axis ("\n" breaks lines).
	X string `json:"x"`
	// Series is the legend entry; bars of one series share a colour.
	Series string `json:"series"`
	// Against is the index of the baseline figure (1: the first baseline).
	Against int `json:"against"`
}
