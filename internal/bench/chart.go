package bench

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/draw"
	"image/png"
	"io"
	"math"
	"os"
	"path/filepath"
	"sort"
	"strings"

	xfont "golang.org/x/image/font"
	"gonum.org/v1/plot"
	"gonum.org/v1/plot/font"
	"gonum.org/v1/plot/plotutil"
	"gonum.org/v1/plot/text"
	"gonum.org/v1/plot/vg"
	vgdraw "gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgimg"
	"gonum.org/v1/plot/vg/vgsvg"
)

// plots lists where the row is drawn: its Plots, and for a row that only sets the
// older Chart and X fields, one series per baseline.
func (r Row) plots() []Plot {
	out := append([]Plot(nil), r.Plots...)
	if r.Chart == "" {
		return out
	}
	for b := 1; b < len(r.Figures); b++ {
		out = append(out, Plot{
			Chart:   cleanName(r.Scenario + " " + r.Chart),
			Title:   r.Scenario + ": " + r.Chart,
			X:       r.X,
			Series:  "vs " + r.Figures[b].Impl,
			Against: b,
		})
	}
	return out
}

// chartData is one chart ready to draw.
type chartData struct {
	Name, Title string
	Groups      []string
	Series      []string
	// Values[series][group] is the ratio; NaN where there is none.
	Values    [][]float64
	Baselines []string
	// Scenarios contributing rows, in order of first appearance.
	Scenarios []string
}

func (d *chartData) index(list *[]string, s string) int {
	for i, x := range *list {
		if x == s {
			return i
		}
	}
	*list = append(*list, s)
	return len(*list) - 1
}

// Baseline names what 1× means on the chart.
func (d *chartData) Baseline() string {
	if len(d.Baselines) == 1 {
		return d.Baselines[0]
	}
	return "baseline"
}

func (d *chartData) axisName() string {
	return fmt.Sprintf("× better than %s (log scale; above the line: rekey is better)", d.Baseline())
}

// charts gathers every chart the rows describe, in order of first appearance.
func (r *Report) charts() []*chartData {
	var out []*chartData
	byName := map[string]*chartData{}
	for _, row := range r.Rows {
		for _, p := range row.plots() {
			if p.Against <= 0 || p.Against >= len(row.Figures) {
				continue
			}
			d := byName[p.Chart]
			if d == nil {
				d = &chartData{Name: p.Chart}
				byName[p.Chart] = d
				out = append(out, d)
			}
			if d.Title == "" {
				d.Title = p.Title
			}
			d.index(&d.Scenarios, row.Scenario)
			d.index(&d.Baselines, baselineName(row.Figures[p.Against].Impl))
			g := d.index(&d.Groups, p.X)
			s := d.index(&d.Series, p.Series)
			for len(d.Values) <= s {
				d.Values = append(d.Values, nil)
			}
			for i := range d.Values {
				for len(d.Values[i]) < len(d.Groups) {
					d.Values[i] = append(d.Values[i], math.NaN())
				}
			}
			if sp := row.Speedup(p.Against); sp > 0 && !math.IsInf(sp, 0) {
				d.Values[s][g] = sp
			}
		}
	}
	return out
}

// baselineName drops the detail in parentheses ("upstream (1 min poll)" is upstream).
func baselineName(impl string) string {
	if i := strings.Index(impl, " ("); i > 0 {
		return impl[:i]
	}
	return impl
}

func cleanName(s string) string {
	s = strings.Map(func(r rune) rune {
		switch {
		case r >= 'a' && r <= 'z' || r >= '0' && r <= '9':
			return r
		case r >= 'A' && r <= 'Z':
			return r + 32
		}
		return '-'
	}, s)
	for strings.Contains(s, "--") {
		s = strings.ReplaceAll(s, "--", "-")
	}
	return strings.Trim(s, "-")
}

// chartFormats are the file types WriteCharts writes for every chart.
var chartFormats = []string{"svg", "png"}

// WriteCharts draws every chart as SVG and PNG into dir.
func (r *Report) WriteCharts(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	for _, d := range r.charts() {
		for _, format := range chartFormats {
			data, err := r.renderChart(d, format)
			if err != nil {
				return fmt.Errorf("chart %s: %w", d.Name, err)
			}
			if err := os.WriteFile(filepath.Join(dir, d.Name+"."+format), data, 0o644); err != nil {
				return err
			}
		}
	}
	return nil
}

var (
	sans     = font.Font{Typeface: "Liberation", Variant: "Sans"}
	sansBold = font.Font{Typeface: "Liberation", Variant: "Sans", Weight: xfont.WeightBold}
)

func textStyle(f font.Font, size float64, xAlign, yAlign float64) text.Style {
	f.Size = vg.Points(size)
	return text.Style{
		Color:   color.Black,
		Font:    f,
		XAlign:  text.XAlignment(xAlign),
		YAlign:  text.YAlignment(yAlign),
		Handler: plot.DefaultTextHandler,
	}
}

// Layout of a chart, in points.
const (
	chartMargin   = 12
	titleSize     = 13
	legendSize    = 10
	footSize      = 7.5
	barWidth      = 26
	groupGap      = 14
	tickSize      = 9
	yAxisRoom     = 60
	baselineRoom  = 110
	minPlotWidth  = 430
	chartHeight   = 330
	pngDPI        = 110
	valueLabelPts = 8
)

// renderChart draws one chart: the title and the legend above the plot area (never on
// it), a log-scale ratio axis, bars that start at the 1× line, each bar labelled with
// its value, and a footer naming the run.
func (r *Report) renderChart(d *chartData, format string) ([]byte, error) {
	// Each group is as wide as its bars or its longest label line, whichever is wider.
	tick := textStyle(sans, tickSize, -0.5, -1)
	groupWidth := float64(max(1, len(d.Series)))*barWidth + groupGap
	for _, g := range d.Groups {
		for _, line := range strings.Split(g, "\n") {
			groupWidth = max(groupWidth, tick.Width(line).Points()+groupGap)
		}
	}
	plotWidth := float64(len(d.Groups))*groupWidth + yAxisRoom + baselineRoom
	titleWidth := textStyle(sansBold, titleSize, 0, 0).Width(d.Title).Points()
	width := vg.Points(max(minPlotWidth, plotWidth, titleWidth) + 2*chartMargin)
	height := vg.Points(chartHeight)

	var canvas vg.CanvasWriterTo
	switch format {
	case "svg":
		canvas = vgsvg.New(width, height)
	case "png":
		canvas = smallPNG{vgimg.NewWith(vgimg.UseWH(width, height), vgimg.UseDPI(pngDPI), vgimg.UseBackgroundColor(color.White))}
	default:
		return nil, fmt.Errorf("unknown chart format %q (use svg or png)", format)
	}
	c := vgdraw.New(canvas)
	c = vgdraw.Crop(c, chartMargin, -chartMargin, chartMargin, -chartMargin)

	// Title, top left.
	title := textStyle(sansBold, titleSize, 0, -1)
	c.FillText(title, vg.Point{X: c.Min.X, Y: c.Max.Y}, d.Title)
	top := c.Max.Y - title.Height(d.Title) - 6

	// Legend: one row of swatches under the title.
	legend := textStyle(sans, legendSize, 0, -0.5)
	x := c.Min.X
	yMid := top - legend.Height("X")/2
	for i, s := range d.Series {
		sw := vg.Points(10)
		c.FillPolygon(seriesColor(i), []vg.Point{
			{X: x, Y: yMid - sw/2}, {X: x + sw, Y: yMid - sw/2}, {X: x + sw, Y: yMid + sw/2}, {X: x, Y: yMid + sw/2},
		})
		c.FillText(legend, vg.Point{X: x + sw + 4, Y: yMid}, s)
		x += sw + 4 + legend.Width(s) + 16
	}
	top = yMid - legend.Height("X")/2 - 8

	// The y axis is named above it, level, so no viewer has to rotate or clip it.
	axisName := textStyle(sans, 9.5, 0, -1)
	c.FillText(axisName, vg.Point{X: c.Min.X, Y: top}, d.axisName())
	top -= axisName.Height("X") + 6

	// Footer: what the bars are and which run they come from.
	foot := textStyle(sans, footSize, 0, 0)
	footText := fmt.Sprintf("Bars start at the 1× line (= %s) and end at the ratio of medians; log scale.\nData: %s.", d.Baseline(), runLabel(r.runOf(d.Scenarios[0])))
	c.FillText(foot, vg.Point{X: c.Min.X, Y: c.Min.Y}, footText)
	bottom := c.Min.Y + foot.Height(footText) + 6

	p, err := r.ratioPlot(d)
	if err != nil {
		return nil, err
	}
	p.Draw(vgdraw.Crop(c, 0, -baselineRoom, bottom-c.Min.Y, top-c.Max.Y))

	var buf bytes.Buffer
	if _, err := canvas.WriteTo(&buf); err != nil {
		return nil, err
	}
	out := buf.Bytes()
	if format == "svg" {
		// Arial has Liberation Sans's metrics, so a viewer without Liberation still fits
		// every label into the space measured for it.
		out = bytes.ReplaceAll(out, []byte("font-family:Liberation Sans;"), []byte("font-family:'Liberation Sans',Arial,Helvetica,sans-serif;"))
	}
	return out, nil
}

// runLabel names the run that measured a chart's (first) scenario.
func runLabel(ri RunInfo) string {
	if ri.Started.IsZero() {
		return "rekey-bench"
	}
	s := "rekey-bench run of " + ri.Started.UTC().Format("2006-01-02")
	if ri.Host.CPUs > 0 {
		s += fmt.Sprintf(", %d CPUs", ri.Host.CPUs)
	}
	if ri.Host.CPU != "" && ri.Host.CPU != "unknown" {
		s += " (" + ri.Host.CPU + ")"
	}
	return s
}

func seriesColor(i int) color.Color { return plotutil.Color(i) }

// ratioPlot is the plot area: axes, ticks, the 1× line and the bars.
func (r *Report) ratioPlot(d *chartData) (*plot.Plot, error) {
	lo, hi := 1.0, 1.0
	for _, vs := range d.Values {
		for _, v := range vs {
			if !math.IsNaN(v) {
				lo, hi = min(lo, v), max(hi, v)
			}
		}
	}
	// Room below the lowest and above the highest bar for its value label.
	lo = math.Pow(10, math.Floor(math.Log10(lo/1.3)*2)/2)
	hi = math.Pow(10, math.Ceil(math.Log10(hi*2.2)*2)/2)
	lo = min(lo, 0.5)
	hi = max(hi, 3)

	p := plot.New()
	p.BackgroundColor = color.Transparent
	p.Y.Scale = plot.LogScale{}
	p.Y.Min, p.Y.Max = lo, hi
	p.Y.Tick.Marker = ratioTicks{}
	p.Y.Tick.Label.Font = sans
	p.Y.Tick.Label.Font.Size = vg.Points(tickSize)
	p.X.Tick.Label.Font = sans
	p.X.Tick.Label.Font.Size = vg.Points(tickSize)
	p.X.Min, p.X.Max = -0.6, float64(len(d.Groups))-0.4
	p.X.Tick.Marker = groupTicks(d.Groups)
	p.X.Padding, p.Y.Padding = 0, 0
	p.X.Tick.Length = 0
	p.Add(&ratioBars{d: d})
	return p, nil
}

// groupTicks puts each group's label under its bars.
type groupTicks []string

func (g groupTicks) Ticks(min, max float64) []plot.Tick {
	var out []plot.Tick
	for i, s := range g {
		out = append(out, plot.Tick{Value: float64(i), Label: s})
	}
	return out
}

// ratioTicks marks 1-2-5 steps on short ranges and decades on long ones.
type ratioTicks struct{}

func (ratioTicks) Ticks(lo, hi float64) []plot.Tick {
	steps := []float64{1, 2, 5}
	if hi/lo > 2000 {
		steps = []float64{1}
	}
	var out []plot.Tick
	for e := math.Floor(math.Log10(lo)); e <= math.Ceil(math.Log10(hi)); e++ {
		for _, s := range steps {
			v := s * math.Pow(10, e)
			if v >= lo*0.999 && v <= hi*1.001 {
				label := ratioLabel(v)
				if v >= 1 {
					label = groupThousands(int64(math.Round(v))) + "×"
				}
				out = append(out, plot.Tick{Value: v, Label: label})
			}
		}
	}
	return out
}

// ratioLabel writes a ratio the way a reader says it: 0.5×, 2×, 1.7×, 1,516×, 31.9k×.
func ratioLabel(v float64) string {
	switch {
	case v >= 10_000:
		return fmt.Sprintf("%.1fk×", v/1000)
	case v >= 100:
		return groupThousands(int64(math.Round(v))) + "×"
	case v >= 10:
		return fmt.Sprintf("%.0f×", v)
	case v >= 0.995 && math.Abs(v-math.Round(v)) < 0.005:
		return fmt.Sprintf("%.0f×", v)
	default:
		return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.2f", v), "0"), ".") + "×"
	}
}

// ratioBars draws the 1× line with its name, then every bar from 1× to its value with
// the value written past its end.
type ratioBars struct{ d *chartData }

func (b *ratioBars) Plot(c vgdraw.Canvas, p *plot.Plot) {
	trX, trY := p.Transforms(&c)
	one := trY(1)
	line := vgdraw.LineStyle{Color: color.Gray{Y: 40}, Width: vg.Points(1.2), Dashes: []vg.Length{vg.Points(4), vg.Points(3)}}
	c.StrokeLine2(line, c.Min.X, one, c.Max.X, one)
	// The line's name sits right of the plot area, where no bar can cover it.
	name := textStyle(sansBold, 9, 0, -0.5)
	c.FillText(name, vg.Point{X: c.Max.X + 4, Y: one}, "1× = "+b.d.Baseline())

	nSeries := len(b.d.Series)
	w := vg.Points(barWidth)
	valueStyle := textStyle(sans, valueLabelPts, -0.5, 0)
	for s, vs := range b.d.Values {
		col := seriesColor(s)
		for g, v := range vs {
			center := trX(float64(g)) + w*vg.Length(float64(s)-float64(nSeries-1)/2)
			if math.IsNaN(v) {
				st := valueStyle
				st.Color = color.Gray{Y: 90}
				c.FillText(st, vg.Point{X: center, Y: one + 3}, "n/a")
				continue
			}
			end := trY(v)
			lo, hi := min(one, end), max(one, end)
			if hi-lo < vg.Points(1) {
				hi = lo + vg.Points(1)
			}
			c.FillPolygon(col, []vg.Point{
				{X: center - w/2 + 1, Y: lo}, {X: center + w/2 - 1, Y: lo},
				{X: center + w/2 - 1, Y: hi}, {X: center - w/2 + 1, Y: hi},
			})
			label := ratioLabel(v)
			st := valueStyle
			at := vg.Point{X: center, Y: hi + 2}
			if v < 1 {
				st.YAlign = -1
				at.Y = lo - 2
			}
			c.FillText(st, at, label)
		}
	}
}

// smallPNG writes the picture as a paletted PNG: a chart has a handful of colours plus
// the anti-aliasing shades of its text, so 256 colours keep it sharp at a third of the
// size.
type smallPNG struct{ *vgimg.Canvas }

func (c smallPNG) WriteTo(w io.Writer) (int64, error) {
	img := c.Image()
	pal := image.NewPaletted(img.Bounds(), chartPalette(img))
	draw.Draw(pal, img.Bounds(), img, img.Bounds().Min, draw.Src)
	var buf bytes.Buffer
	if err := (&png.Encoder{CompressionLevel: png.BestCompression}).Encode(&buf, pal); err != nil {
		return 0, err
	}
	return buf.WriteTo(w)
}

// chartPalette is the 256 most frequent colours of img.
func chartPalette(img image.Image) color.Palette {
	counts := map[color.RGBA]int{}
	b := img.Bounds()
	for y := b.Min.Y; y < b.Max.Y; y++ {
		for x := b.Min.X; x < b.Max.X; x++ {
			counts[color.RGBAModel.Convert(img.At(x, y)).(color.RGBA)]++
		}
	}
	colors := make([]color.RGBA, 0, len(counts))
	for c := range counts {
		colors = append(colors, c)
	}
	sort.Slice(colors, func(i, j int) bool {
		if counts[colors[i]] != counts[colors[j]] {
			return counts[colors[i]] > counts[colors[j]]
		}
		a, b := colors[i], colors[j]
		return uint32(a.R)<<24|uint32(a.G)<<16|uint32(a.B)<<8|uint32(a.A) < uint32(b.R)<<24|uint32(b.G)<<16|uint32(b.B)<<8|uint32(b.A)
	})
	pal := make(color.Palette, 0, 256)
	for _, c := range colors[:min(256, len(colors))] {
		pal = append(pal, c)
	}
	return pal
}
