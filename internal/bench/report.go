package bench

import (
	"encoding/json"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"time"
)

// Report collects rows and renders them. Its JSON form (WriteJSON, ReadReport) keeps a
// run so the markdown and the charts can be drawn again without measuring again.
type Report struct {
	Command string    `json:"command"`
	Started time.Time `json:"started"`
	Host    Host      `json:"host"`
	Rows    []Row     `json:"rows"`
	// ScenarioRuns names the run of each scenario measured by another command than
	// Command (see Merge), by scenario.
	ScenarioRuns map[string]RunInfo `json:"scenarioRuns,omitempty"`
}

// RunInfo is the command and start of one harness run.
type RunInfo struct {
	Command string    `json:"command"`
	Started time.Time `json:"started"`
	Host    Host      `json:"host"`
}

// runOf is the run that measured scenario sc.
func (r *Report) runOf(sc string) RunInfo {
	if ri, ok := r.ScenarioRuns[sc]; ok {
		return ri
	}
	return RunInfo{Command: r.Command, Started: r.Started, Host: r.Host}
}

// Merge puts this run's rows into an earlier report: old keeps the scenarios this run
// did not measure, each with the run that did; a scenario this run measured replaces
// old's rows in place (or is appended). The merged report's Command and Started are
// those of its first scenario's run, and ScenarioRuns names every other run, so a
// section measured alone (a scenario that takes minutes) is not mistaken for part of
// the main run, and the main run's figures are not measured again.
func (r *Report) Merge(old *Report) *Report {
	fresh := map[string]bool{}
	for _, sc := range r.scenarios() {
		fresh[sc] = true
	}
	runs := map[string]RunInfo{}
	var rows []Row
	placed := map[string]bool{}
	for _, row := range old.Rows {
		sc := row.Scenario
		if !fresh[sc] {
			runs[sc] = old.runOf(sc)
			rows = append(rows, row)
			continue
		}
		if !placed[sc] {
			placed[sc] = true
			rows = append(rows, r.rowsOf(sc)...)
		}
	}
	for _, sc := range r.scenarios() {
		runs[sc] = r.runOf(sc)
		if !placed[sc] {
			rows = append(rows, r.rowsOf(sc)...)
		}
	}
	out := &Report{Command: r.Command, Started: r.Started, Host: r.Host, Rows: rows}
	if len(rows) == 0 {
		return out
	}
	top := runs[rows[0].Scenario]
	out.Command, out.Started, out.Host = top.Command, top.Started, top.Host
	for sc, ri := range runs {
		if ri.Command != top.Command || !ri.Started.Equal(top.Started) {
			if out.ScenarioRuns == nil {
				out.ScenarioRuns = map[string]RunInfo{}
			}
			out.ScenarioRuns[sc] = ri
		}
	}
	return out
}

// Host describes the machine a run measured.
type Host struct {
	OS         string `json:"os"`
	Arch       string `json:"arch"`
	CPUs       int    `json:"cpus"`
	GOMAXPROCS int    `json:"gomaxprocs"`
	GoVersion  string `json:"goVersion"`
	CPU        string `json:"cpu"`
}

// ThisHost describes the running machine.
func ThisHost() Host {
	return Host{OS: runtime.GOOS, Arch: runtime.GOARCH, CPUs: runtime.NumCPU(), GOMAXPROCS: runtime.GOMAXPROCS(0), GoVersion: runtime.Version(), CPU: cpuModel()}
}

// WriteJSON writes the report as indented JSON.
func (r *Report) WriteJSON(w io.Writer) error {
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false)
	return enc.Encode(r)
}

// ReadReport reads a report WriteJSON wrote.
func ReadReport(rd io.Reader) (*Report, error) {
	var r Report
	dec := json.NewDecoder(rd)
	dec.DisallowUnknownFields()
	if err := dec.Decode(&r); err != nil {
		return nil, fmt.Errorf("reading benchmark results: %w (write them with rekey-bench -results)", err)
	}
	if len(r.Rows) == 0 {
		return nil, fmt.Errorf("benchmark results hold no rows")
	}
	for i, row := range r.Rows {
		if len(row.Figures) == 0 {
			return nil, fmt.Errorf("benchmark results: row %d (%s %s) has no figures", i, row.Scenario, row.Case)
		}
	}
	return &r, nil
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

// WriteMarkdown renders every scenario as a table.
func (r *Report) WriteMarkdown(w io.Writer, chartDir string) {
	fmt.Fprintf(w, "Command: `%s`  \n", r.Command)
	h := r.Host
	fmt.Fprintf(w, "Run: %s, %s/%s, %d CPUs (GOMAXPROCS %d), %s  \n", r.Started.UTC().Format(time.RFC3339), h.OS, h.Arch, h.CPUs, h.GOMAXPROCS, h.GoVersion)
	fmt.Fprintf(w, "CPU: %s  \n", h.CPU)
	fmt.Fprintf(w, "Versions: rekey (this commit) vs k8s.io/apiserver v0.37.2. Medians with (min–max) over alternating samples; ×N = how many times better rekey's median is.\n\n")
	if m := r.Missed(); m > 0 {
		fmt.Fprintf(w, "**%d target(s) MISSED** — listed as MISSED below.\n\n", m)
	} else {
		fmt.Fprintf(w, "All targets checked in this run were met.\n\n")
	}
	charts := r.charts()
	for _, sc := range r.scenarios() {
		fmt.Fprintf(w, "### %s\n\n", sc)
		if ri, ok := r.ScenarioRuns[sc]; ok {
			h := ri.Host
			fmt.Fprintf(w, "Measured by another run than the one above. Command: `%s`  \nRun: %s, %s/%s, %d CPUs (GOMAXPROCS %d), %s, CPU: %s\n\n",
				ri.Command, ri.Started.UTC().Format(time.RFC3339), h.OS, h.Arch, h.CPUs, h.GOMAXPROCS, h.GoVersion, h.CPU)
		}
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
			for _, d := range charts {
				if d.Scenarios[0] == sc {
					fmt.Fprintf(w, "\n![%s](%s)\n", d.Title, filepath.ToSlash(filepath.Join(chartDir, d.Name+".png")))
				}
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
