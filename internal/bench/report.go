package bench

import (
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"sort"
	"strings"
	"time"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/vg"
)

// Figure is one implementation's result in one row.
type Figure struct {
	Impl  string
	Unit  string // "ns/op", "ms", "ops/s", ...
	Stats Stats
	// HigherIsBetter is true for throughputs.
	HigherIsBetter bool
	// Allocs and Bytes are per-op medians; negative when not measured.
	Allocs, Bytes float64
	// Retained is heap bytes still live after the run, when measured (else negative).
	Retained float64
	// Note replaces the figure in the table (e.g. "not run in short mode").
	Note string
}

// Check is one target verdict.
type Check struct {
	Desc string
	Met  bool
	Got  string
}

// Row is one case of a scenario: the first figure is rekey's.
type Row struct {
	Scenario string
	Case     string
	// Chart groups rows into one chart; X is the row's label on it.
	Chart, X string
	Figures  []Figure
	Checks   []Check
}

// Speedup of the first figure over figure i (>1 means rekey is better).
func (r Row) Speedup(i int) float64 {
	ours, base := r.Figures[0], r.Figures[i]
	if ours.Stats.Median == 0 || base.Stats.Median == 0 {
		return math.NaN()
	}
	if ours.HigherIsBetter {
		return ours.Stats.Median / base.Stats.Median
	}
	return base.Stats.Median / ours.Stats.Median
}

// Report collects rows and renders them.
type Report struct {
	// ChartFormat is the chart file type: "svg" (default) or "png".
	ChartFormat string
	Command     string
	Started     time.Time
	Rows        []Row
}

// Missed counts target checks that were not met.
func (r *Report) Missed() int {
	n := 0
	for _, row := range r.Rows {
		for _, c := range row.Checks {
			if !c.Met {
				n++
			}
		}
	}
	return n
}

func fmtStat(f Figure) string {
	if f.Note != "" {
		return f.Note
	}
	unit := f.Unit
	v := f.Stats
	scale := func(x float64) string {
		switch {
		case unit == "ns/op" && x >= 1e6:
			return fmt.Sprintf("%.2f ms", x/1e6)
		case unit == "ns/op" && x >= 1e3:
			return fmt.Sprintf("%.2f µs", x/1e3)
		case unit == "ns/op":
			return fmt.Sprintf("%.0f ns", x)
		case x >= 100 || x <= -100:
			return fmt.Sprintf("%.0f %s", x, unit)
		case x >= 10 || x <= -10:
			return fmt.Sprintf("%.1f %s", x, unit)
		default:
			return fmt.Sprintf("%.3g %s", x, unit)
		}
	}
	if v.Min == v.Max {
		return scale(v.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", scale(v.Median), strings.TrimSuffix(scale(v.Min), " "+unitSuffix(unit, v.Min)), scale(v.Max))
}

func unitSuffix(unit string, x float64) string {
	if unit != "ns/op" {
		return unit
	}
	switch {
	case x >= 1e6:
		return "ms"
	case x >= 1e3:
		return "µs"
	default:
		return "ns"
	}
}

// WriteMarkdown renders every scenario as a table.
func (r *Report) WriteMarkdown(w io.Writer, chartDir string) {
	fmt.Fprintf(w, "Command: `%s`  \n", r.Command)
	fmt.Fprintf(w, "Run: %s, %s/%s, %d CPUs (GOMAXPROCS %d), %s  \n", r.Started.UTC().Format(time.RFC3339), runtime.GOOS, runtime.GOARCH, runtime.NumCPU(), runtime.GOMAXPROCS(0), runtime.Version())
	fmt.Fprintf(w, "CPU: %s  \n", cpuModel())
	fmt.Fprintf(w, "Versions: rekey (this commit) vs k8s.io/apiserver v0.37.2. Medians with (min–max) over alternating samples; ×N = how many times better rekey's median is.\n\n")
	if m := r.Missed(); m > 0 {
		fmt.Fprintf(w, "**%d target(s) MISSED** — listed as MISSED below.\n\n", m)
	} else {
		fmt.Fprintf(w, "All targets checked in this run were met.\n\n")
	}
	for _, sc := range r.scenarios() {
		fmt.Fprintf(w, "### %s\n\n", sc)
		rows := r.rowsOf(sc)
		var impls []string
		for _, f := range rows[0].Figures {
			impls = append(impls, f.Impl)
		}
		fmt.Fprintf(w, "| case |")
		for _, im := range impls {
			fmt.Fprintf(w, " %s |", im)
		}
		for _, im := range impls[1:] {
			fmt.Fprintf(w, " vs %s |", im)
		}
		fmt.Fprintf(w, " allocs/op (%s) | target |\n|---|", strings.Join(impls, " / "))
		for range impls {
			fmt.Fprintf(w, "---:|")
		}
		for range impls[1:] {
			fmt.Fprintf(w, "---:|")
		}
		fmt.Fprintf(w, "---:|---|\n")
		for _, row := range rows {
			fmt.Fprintf(w, "| %s |", row.Case)
			for _, f := range row.Figures {
				fmt.Fprintf(w, " %s |", fmtStat(f))
			}
			for i := 1; i < len(row.Figures); i++ {
				if sp := row.Speedup(i); math.IsNaN(sp) || math.IsInf(sp, 0) {
					fmt.Fprintf(w, " – |")
				} else {
					fmt.Fprintf(w, " ×%.2f |", sp)
				}
			}
			var allocs []string
			for _, f := range row.Figures {
				if f.Allocs < 0 {
					allocs = append(allocs, "–")
				} else {
					allocs = append(allocs, fmt.Sprintf("%.0f", f.Allocs))
				}
			}
			fmt.Fprintf(w, " %s |", strings.Join(allocs, " / "))
			var checks []string
			for _, c := range row.Checks {
				verdict := "met"
				if !c.Met {
					verdict = "**MISSED**"
				}
				checks = append(checks, fmt.Sprintf("%s: %s (%s)", c.Desc, verdict, c.Got))
			}
			fmt.Fprintf(w, " %s |\n", strings.Join(checks, "; "))
		}
		if chartDir != "" {
			for _, chart := range r.chartsOf(sc) {
				fmt.Fprintf(w, "\n![%s](%s)\n", chart, filepath.ToSlash(filepath.Join(chartDir, r.chartFile(sc, chart))))
			}
		}
		fmt.Fprintln(w)
	}
}

func (r *Report) scenarios() []string {
	var out []string
	seen := map[string]bool{}
	for _, row := range r.Rows {
		if !seen[row.Scenario] {
			seen[row.Scenario] = true
			out = append(out, row.Scenario)
		}
	}
	return out
}

func (r *Report) rowsOf(sc string) []Row {
	var out []Row
	for _, row := range r.Rows {
		if row.Scenario == sc {
			out = append(out, row)
		}
	}
	return out
}

func (r *Report) chartsOf(sc string) []string {
	var out []string
	seen := map[string]bool{}
	for _, row := range r.rowsOf(sc) {
		if row.Chart != "" && !seen[row.Chart] {
			seen[row.Chart] = true
			out = append(out, row.Chart)
		}
	}
	sort.Strings(out)
	return out
}

func (r *Report) chartFile(scenario, chart string) string {
	clean := func(s string) string {
		return strings.Map(func(r rune) rune {
			if r >= 'a' && r <= 'z' || r >= '0' && r <= '9' || r == '-' {
				return r
			}
			if r >= 'A' && r <= 'Z' {
				return r + 32
			}
			return '-'
		}, s)
	}
	ext := r.ChartFormat
	if ext == "" {
		ext = "svg"
	}
	return clean(scenario) + "_" + clean(chart) + "." + ext
}

// WriteCharts draws one grouped bar chart per chart group: rekey's speedup over each
// baseline by X, with a line at 1× (parity).
func (r *Report) WriteCharts(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, sc := range r.scenarios() {
		for _, chart := range r.chartsOf(sc) {
			var rows []Row
			for _, row := range r.rowsOf(sc) {
				if row.Chart == chart {
					rows = append(rows, row)
				}
			}
			p := plot.New()
			p.Title.Text = sc + ": " + chart
			p.Y.Label.Text = "rekey speedup (×, higher is better; capped at 12)"
			var labels []string
			for _, row := range rows {
				labels = append(labels, row.X)
			}
			nBase := len(rows[0].Figures) - 1
			width := vg.Points(18)
			// Speedups span 0.3× to thousands (identity). Bars are drawn up to chartCap and
			// every bar carries its value, so the interesting range stays readable.
			const chartCap = 12.0
			var labelXYs []plotter.XY
			var labelTexts []string
			for b := 1; b <= nBase; b++ {
				vals := make(plotter.Values, len(rows))
				for i, row := range rows {
					if b < len(row.Figures) {
						s := row.Speedup(b)
						if math.IsNaN(s) || math.IsInf(s, 0) {
							s = 0
						}
						vals[i] = min(s, chartCap)
						offset := float64(b-1) - float64(nBase-1)/2
						labelXYs = append(labelXYs, plotter.XY{X: float64(i) + offset*0.3, Y: min(s, chartCap) + 0.15})
						label := fmt.Sprintf("%.2f", s)
						if s >= 100 {
							label = fmt.Sprintf("%.0f", s)
						}
						labelTexts = append(labelTexts, label)
					}
				}
				bars, err := plotter.NewBarChart(vals, width)
				if err != nil {
					return err
				}
				bars.Color = plotutil.Color(b - 1)
				bars.LineStyle.Width = 0
				bars.Offset = width * vg.Length(float64(b-1)-float64(nBase-1)/2)
				p.Add(bars)
				p.Legend.Add("vs "+rows[0].Figures[b].Impl, bars)
			}
			if labels, err := plotter.NewLabels(plotter.XYLabels{XYs: labelXYs, Labels: labelTexts}); err == nil {
				for i := range labels.TextStyle {
					labels.TextStyle[i].Font.Size = vg.Points(7)
					labels.TextStyle[i].XAlign = -0.5
				}
				p.Add(labels)
			}
			p.Y.Max = chartCap + 1
			parity := plotter.NewFunction(func(float64) float64 { return 1 })
			parity.Dashes = []vg.Length{vg.Points(3), vg.Points(3)}
			p.Add(parity)
			p.Legend.Top = true
			p.NominalX(labels...)
			p.Y.Min = 0
			if err := p.Save(vg.Length(80+60*len(rows))*vg.Points(1)+4*vg.Inch, 3.5*vg.Inch, filepath.Join(dir, r.chartFile(sc, chart))); err != nil {
				return err
			}
		}
	}
	return nil
}

func cpuModel() string {
	data, err := os.ReadFile("/proc/cpuinfo")
	if err != nil {
		return "unknown"
	}
	for _, line := range strings.Split(string(data), "\n") {
		if strings.HasPrefix(line, "model name") {
			if i := strings.Index(line, ":"); i >= 0 {
				return strings.TrimSpace(line[i+1:])
			}
		}
	}
	return "unknown"
}
