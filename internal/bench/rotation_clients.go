package bench

import (
	"fmt"
	"maps"
	"os"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// What the rotation costs the clients: every request of the writers and the sampler is
// timed, by who sent it and its verb, in two windows: before the rotation (from the
// load's start to the first edit) and during it (from the first edit until the old key
// is removed everywhere). The requests answered while the stored Secrets are rewritten
// count a third time, in the rewrite window: rekey's migrate stage (from `rotate`
// reporting it until it reports the remove stage) and upstream's replace of every
// Secret. The rest of "during" waits for files and reloads, which no pacing touches, so
// the rewrite window tells what the re-encryption itself cost. Each side's p50 and p99
// per window are reported beside its times.

// Client latency windows.
const (
	windowBefore  = "before"
	windowDuring  = "during"
	windowRewrite = "rewrite"
)

// clientWindows are the windows in the order they are reported.
var clientWindows = []string{windowBefore, windowDuring, windowRewrite}

// windowText names a window in the report's rows.
func windowText(w string) string {
	switch w {
	case windowRewrite:
		return "during the rewrite"
	default:
		return w + " the rotation"
	}
}

// rotationBaselineWindow is how long the load runs before the rotation starts: the
// "before" window, and on rekey's side the requests its pacing takes its baseline from
// (at least 50 of a class in the 10 minutes before a migration).
const rotationBaselineWindow = 15 * time.Second

// clientLatencies records the timed requests of one side. Safe for concurrent use.
type clientLatencies struct {
	mu sync.Mutex
	// window is where requests answered now go; "": recorded nowhere (after the
	// rotation). rewriting: they go to windowRewrite too.
	window    string
	rewriting bool
	// rewriteSince is when the rewrite window opened (while rewriting); rewrote sums
	// the time it was open.
	rewriteSince time.Time
	rewrote      time.Duration
	// ops are every request recorded, in the order answered: what the summaries and
	// the ops file (writeOps) are made of.
	ops []answeredRequest
}

// answeredRequest is one recorded request: when it was answered, its window, whether
// it was answered during the rewrite too, its kind and its latency.
type answeredRequest struct {
	at      time.Time
	window  string
	rewrite bool
	kind    string
	latency time.Duration
}

func newClientLatencies() *clientLatencies {
	return &clientLatencies{window: windowBefore}
}

// observer is the testbed.LatencyFunc of sender's requests (writers, sampler).
func (c *clientLatencies) observer(sender string) testbed.LatencyFunc {
	return func(verb string, d time.Duration) {
		c.mu.Lock()
		defer c.mu.Unlock()
		if c.window == "" {
			return
		}
		c.ops = append(c.ops, answeredRequest{at: time.Now(), window: c.window, rewrite: c.rewriting, kind: sender + " " + verb, latency: d})
	}
}

// rewrite makes requests answered from now on count in windowRewrite too (on: true)
// or no longer.
func (c *clientLatencies) rewrite(on bool) {
	c.mu.Lock()
	defer c.mu.Unlock()
	switch now := time.Now(); {
	case on && !c.rewriting:
		c.rewriteSince = now
	case !on && c.rewriting:
		c.rewrote += now.Sub(c.rewriteSince)
	}
	c.rewriting = on
}

// rewriteTime is how long the rewrite window was open.
func (c *clientLatencies) rewriteTime() time.Duration {
	c.mu.Lock()
	defer c.mu.Unlock()
	return c.rewrote
}

// enter makes requests answered from now on count in window ("": none).
func (c *clientLatencies) enter(window string) {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.window = window
}

// writeOps writes every recorded request to path as CSV (answeredAt in RFC 3339 with
// nanoseconds, window, requests, latencyMs), for reading the clients' latency second by
// second against the shims' logs (-rotation-ops-dir).
func (c *clientLatencies) writeOps(path string) error {
	c.mu.Lock()
	ops := slices.Clone(c.ops)
	c.mu.Unlock()
	var b strings.Builder
	b.WriteString("answeredAt,window,requests,latencyMs\n")
	for _, o := range ops {
		w := o.window
		if o.rewrite {
			w = windowRewrite
		}
		fmt.Fprintf(&b, "%s,%s,%s,%.3f\n", o.at.UTC().Format(time.RFC3339Nano), w, o.kind, float64(o.latency)/float64(time.Millisecond))
	}
	return os.WriteFile(path, []byte(b.String()), 0o644)
}

// latencySummary is one window's figures of one kind of request.
type latencySummary struct {
	Window   string  `json:"window"`
	Requests string  `json:"requests"` // sender and verb: "sampler get", "writers update"
	N        int     `json:"n"`
	P50ms    float64 `json:"p50Ms"`
	P99ms    float64 `json:"p99Ms"`
}

// summaries are the figures of every window and kind recorded, before first, kinds
// sorted.
func (c *clientLatencies) summaries() []latencySummary {
	c.mu.Lock()
	defer c.mu.Unlock()
	samples := map[string]map[string][]time.Duration{} // window → kind → latencies
	add := func(window, kind string, d time.Duration) {
		if samples[window] == nil {
			samples[window] = map[string][]time.Duration{}
		}
		samples[window][kind] = append(samples[window][kind], d)
	}
	for _, o := range c.ops {
		add(o.window, o.kind, o.latency)
		if o.rewrite {
			add(windowRewrite, o.kind, o.latency)
		}
	}
	var out []latencySummary
	for _, w := range clientWindows {
		for _, k := range slices.Sorted(maps.Keys(samples[w])) {
			ds := samples[w][k]
			ms := make([]float64, len(ds))
			for i, d := range ds {
				ms[i] = float64(d) / float64(time.Millisecond)
			}
			out = append(out, latencySummary{Window: w, Requests: k, N: len(ds), P50ms: percentile(ms, 50), P99ms: percentile(ms, 99)})
		}
	}
	return out
}

// latencyText is a side's summaries on one line per kind: "sampler get: p50 2.1 ms,
// p99 9.8 ms before (n 3000); p50 …, p99 … during (n …); p50 …, p99 … rewrite (n …);
// p99 ×1.4" (the ratio is during's to before's).
func latencyText(ss []latencySummary) string {
	byKind := map[string]map[string]latencySummary{}
	for _, s := range ss {
		if byKind[s.Requests] == nil {
			byKind[s.Requests] = map[string]latencySummary{}
		}
		byKind[s.Requests][s.Window] = s
	}
	var lines []string
	for _, k := range slices.Sorted(maps.Keys(byKind)) {
		var parts []string
		for _, w := range clientWindows {
			if s, ok := byKind[k][w]; ok {
				parts = append(parts, fmt.Sprintf("p50 %.1f ms, p99 %.1f ms %s (n %d)", s.P50ms, s.P99ms, w, s.N))
			}
		}
		line := k + ": " + strings.Join(parts, "; ")
		if b, d := byKind[k][windowBefore], byKind[k][windowDuring]; b.N > 0 && d.N > 0 && b.P99ms > 0 {
			line += fmt.Sprintf("; p99 ×%.2f", d.P99ms/b.P99ms)
		}
		lines = append(lines, line)
	}
	return strings.Join(lines, "\n")
}

// clientLatencyRows are the clients' p50 and p99 per kind of request, before and
// during the rotation and during its rewrite, on both sides (sides: rekey's first, the baseline's second, in
// the order of the rows' figures); the rows of p99 during the rotation check rekey's
// against 1.5 × its p99 before (issue 34's target), and say the baseline's.
func clientLatencyRows(res map[string]*rotationResult, sides []string, row func(c, unit string, value func(*rotationResult) float64) Row) []Row {
	find := func(r *rotationResult, window, kind string) (latencySummary, bool) {
		for _, s := range r.clients {
			if s.Window == window && s.Requests == kind {
				return s, true
			}
		}
		return latencySummary{}, false
	}
	kinds := map[string]bool{}
	for _, r := range res {
		for _, s := range r.clients {
			kinds[s.Requests] = true
		}
	}
	var rows []Row
	for _, kind := range slices.Sorted(maps.Keys(kinds)) {
		for _, window := range clientWindows {
			for _, q := range []string{"p50", "p99"} {
				r := row(fmt.Sprintf("clients' %s, %s, %s", q, kind, windowText(window)), "ms", func(r *rotationResult) float64 {
					s, _ := find(r, window, kind)
					if q == "p50" {
						return s.P50ms
					}
					return s.P99ms
				})
				for i, side := range sides {
					if r.Figures[i].Note == "" && res[side] != nil {
						if _, ok := find(res[side], window, kind); !ok {
							r.Figures[i].Note = "no such request"
						}
					}
				}
				if window == windowDuring && q == "p99" {
					r.Checks = clientLatencyChecks(res, sides, kind, find)
				}
				rows = append(rows, r)
			}
		}
	}
	return rows
}

// maxClientP99Factor is issue 34's bound on rekey's side: the clients' p99 during the
// rotation at most this many times their p99 before it.
const maxClientP99Factor = 1.5

// minJudgedRequests a kind of request needs in both windows for its p99 to be judged:
// the p99 of fewer is their slowest or second slowest (the writers' creates, one in 50
// of their requests, are about 60 in the 15 s before a rotation), and one request
// caught behind a garbage collection decided the check. Such a kind's figures are
// reported, unjudged.
const minJudgedRequests = 100

func clientLatencyChecks(res map[string]*rotationResult, sides []string, kind string, find func(*rotationResult, string, string) (latencySummary, bool)) []Check {
	ratio := func(side string) (float64, string, bool) {
		r := res[side]
		if r == nil {
			return 0, "", false
		}
		b, okB := find(r, windowBefore, kind)
		d, okD := find(r, windowDuring, kind)
		if !okB || !okD || b.P99ms <= 0 || b.N < minJudgedRequests || d.N < minJudgedRequests {
			return 0, "", false
		}
		x := d.P99ms / b.P99ms
		return x, fmt.Sprintf("%.1f → %.1f ms, ×%.2f", b.P99ms, d.P99ms, x), true
	}
	var checks []Check
	if x, text, ok := ratio(sides[0]); ok {
		if _, up, ok := ratio(sides[1]); ok {
			text += "; " + sides[1] + " " + up
		}
		checks = append(checks, Check{Desc: fmt.Sprintf("%s: p99 during ≤ %.1f× before", sides[0], maxClientP99Factor), Met: x <= maxClientP99Factor, Got: text})
	}
	return checks
}
