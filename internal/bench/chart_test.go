package bench

import (
	"bytes"
	"image"
	"image/png"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

func fig(impl string, ns float64) Figure {
	return Figure{Impl: impl, Unit: "ns/op", Stats: Stats{Median: ns, Min: ns * 0.9, Max: ns * 1.2}, Allocs: 1, Bytes: 256, Retained: -1}
}

func sampleReport() *Report {
	return &Report{
		Command: "rekey-bench -short",
		Started: time.Date(2026, 11, 22, 1, 40, 15, 0, time.UTC),
		Host:    Host{OS: "linux", Arch: "amd64", CPUs: 2, GOMAXPROCS: 2, GoVersion: "go1.26.8", CPU: "AMD EPYC"},
		Rows: []Row{
			{Scenario: "transform", Case: "identity write 1 MiB serial", Plots: transformPlots("identity", "write", 1<<20, "serial"),
				Figures: []Figure{fig("rekey", 7), fig("upstream", 223_323), fig("raw AES-256-GCM", 600_000)}},
			{Scenario: "transform", Case: "aesgcm read 4 KiB serial", Plots: transformPlots("aesgcm", "read", 4<<10, "serial"),
				Figures: []Figure{fig("rekey", 3030), fig("upstream", 3770), fig("raw AES-256-GCM", 2510)},
				Checks:  []Check{{Desc: "≥2× upstream", Met: false, Got: "×1.24"}}},
			{Scenario: "kms v2 gRPC", Case: "Status", Chart: "round trip", X: "Status",
				Figures: []Figure{fig("rekey", 120), fig("upstream", 130)}},
			{Scenario: "reload", Case: "rename → first write with a new aesgcm key", Plots: []Plot{headlinePlot("reload:\nnew aesgcm key")},
				Figures: []Figure{{Impl: "rekey", Unit: "ms", Stats: Stats{Median: 11.3}, Allocs: -1, Bytes: -1, Retained: -1},
					{Impl: "upstream (1 min poll)", Unit: "ms", Allocs: -1, Bytes: -1, Retained: -1, Note: "not run in short mode"}}},
		},
	}
}

// The JSON form keeps everything the markdown and the charts need, so `make charts`
// draws the same charts as the run did.
func TestReportJSONRoundTrip(t *testing.T) {
	r := sampleReport()
	var buf bytes.Buffer
	if err := r.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	got, err := ReadReport(&buf)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, r) {
		t.Fatalf("round trip changed the report:\n got %+v\nwant %+v", got, r)
	}
	if _, err := ReadReport(strings.NewReader(`{"rows":[]}`)); err == nil {
		t.Fatal("ReadReport accepted results without rows")
	}
	if _, err := ReadReport(strings.NewReader(`{"rows":[{"scenario":"x","case":"y","figures":[]}]}`)); err == nil {
		t.Fatal("ReadReport accepted a row without figures")
	}
}

func chartNamed(t *testing.T, r *Report, name string) *chartData {
	t.Helper()
	for _, d := range r.charts() {
		if d.Name == name {
			return d
		}
	}
	t.Fatalf("no chart %q", name)
	return nil
}

// Ratios are drawn at their value on a log axis: no cap, so a 31,903× bar is taller
// than a 75× one and its label matches it.
func TestChartsKeepLargeRatios(t *testing.T) {
	r := sampleReport()
	d := chartNamed(t, r, "transform-identity")
	if want := 223_323.0 / 7; math.Abs(d.Values[0][0]-want) > 1e-9 {
		t.Fatalf("identity 1 MiB ratio = %v, want %v (uncapped)", d.Values[0][0], want)
	}
	if got := ratioLabel(d.Values[0][0]); got != "31.9k×" {
		t.Fatalf("label %q, want 31.9k×", got)
	}
	floor := chartNamed(t, r, "cipher-floor")
	if floor.Baseline() != "raw AES-256-GCM" || floor.Values[0][0] >= 1 {
		t.Fatalf("cipher floor chart: baseline %q, value %v; want raw AES-256-GCM and a ratio below 1", floor.Baseline(), floor.Values[0][0])
	}
	// A row with only Chart and X gets one series per baseline, as before Plots existed.
	grpc := chartNamed(t, r, "kms-v2-grpc-round-trip")
	if !reflect.DeepEqual(grpc.Series, []string{"vs upstream"}) || !reflect.DeepEqual(grpc.Groups, []string{"Status"}) {
		t.Fatalf("legacy chart: series %v groups %v", grpc.Series, grpc.Groups)
	}
	// A baseline without a figure leaves a gap (drawn as n/a), not a zero bar.
	head := chartNamed(t, r, "headline")
	if head.Baseline() != "upstream" || !math.IsNaN(head.Values[0][0]) {
		t.Fatalf("headline: baseline %q value %v; want upstream and NaN", head.Baseline(), head.Values[0][0])
	}
}

func TestRatioLabel(t *testing.T) {
	for v, want := range map[float64]string{0.56: "0.56×", 0.5: "0.5×", 1: "1×", 1.004: "1×", 1.24: "1.24×", 2: "2×", 5.77: "5.77×", 25.6: "26×", 1516.01: "1,516×", 31903.4: "31.9k×"} {
		if got := ratioLabel(v); got != want {
			t.Errorf("ratioLabel(%v) = %q, want %q", v, got, want)
		}
	}
}

// Nothing is drawn into the outer margin of a PNG: a title, legend, axis name or label
// running off the canvas would colour its edge pixels.
func TestChartNothingTouchesTheEdge(t *testing.T) {
	r := sampleReport()
	r.Rows[0].Plots[0].Title = "a deliberately long title that must widen the chart instead of running off its right edge"
	for _, d := range r.charts() {
		data, err := r.renderChart(d, "png")
		if err != nil {
			t.Fatal(err)
		}
		img, err := png.Decode(bytes.NewReader(data))
		if err != nil {
			t.Fatal(err)
		}
		b := img.Bounds()
		const edge = 10 // pixels; the margin is 12 pt, about 18 pixels
		for y := b.Min.Y; y < b.Max.Y; y++ {
			for x := b.Min.X; x < b.Max.X; x++ {
				if x >= b.Min.X+edge && x < b.Max.X-edge && y >= b.Min.Y+edge && y < b.Max.Y-edge {
					continue
				}
				if !white(img, x, y) {
					t.Fatalf("chart %s: pixel (%d,%d) of %v on the edge is not background", d.Name, x, y, b.Size())
				}
			}
		}
		svg, err := r.renderChart(d, "svg")
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(svg, []byte("Arial")) {
			t.Fatalf("chart %s: SVG names no metric-compatible fallback font", d.Name)
		}
	}
}

func white(img image.Image, x, y int) bool {
	r, g, b, _ := img.At(x, y).RGBA()
	return r > 0xf000 && g > 0xf000 && b > 0xf000
}
