package bench

import (
	"strings"
	"testing"
	"time"
)

func TestControllerRows(t *testing.T) {
	s := func(v ...float64) []time.Duration {
		var out []time.Duration
		for _, x := range v {
			out = append(out, time.Duration(x*float64(time.Second)))
		}
		return out
	}
	rk := &controllerResult{rotationResult: rotationResult{side: "rekey", total: 70 * time.Second, edits: 2, underNew: 10_100, stored: 10_100},
		delays: [][]time.Duration{s(3, 41, 12), s(58, 2, 30)}}
	gd := &controllerResult{rotationResult: rotationResult{side: "gardener", total: 280 * time.Second, edits: 3, underNew: 10_100, stored: 10_100, rewritten: 10_050},
		delays: [][]time.Duration{s(3, 41, 12), s(58, 2, 30), s(1, 1, 59)}, restarts: 9, outOfLB: 27 * time.Second, excused: 4}
	cfg := controllerConfig{objects: 10_000, maxDelay: time.Minute}
	rows := controllerRows(map[string]*controllerResult{"rekey": rk, "gardener": gd}, cfg)
	if want := "controller (10,000 Secrets, 3 hosted apiservers, 3-member etcd, projection delays 0–60 s)"; rows[0].Scenario != want {
		t.Fatalf("scenario %q, want %q", rows[0].Scenario, want)
	}
	total := rows[0]
	if sp := total.Speedup(1); sp != 4 {
		t.Fatalf("speedup %v, want 4", sp)
	}
	if len(total.Plots) != 1 || total.Plots[0].Against != 1 {
		t.Fatalf("plots %+v", total.Plots)
	}
	// The goal: 41 s + 58 s + 10 s = 109 s; 70 s meets it.
	if c := total.Checks[0]; !c.Met || !strings.Contains(c.Got, "70.0 s against 109.0 s") || !strings.Contains(c.Got, "51.0 s") {
		t.Fatalf("goal check %+v", c)
	}
	byCase := map[string]Row{}
	for _, r := range rows {
		byCase[strings.SplitN(r.Case, " ", 3)[0]+" "+strings.SplitN(r.Case, " ", 3)[1]] = r
	}
	if r := byCase["apiserver restarts"]; r.Figures[0].Stats.Median != 0 || r.Figures[1].Stats.Median != 9 || !r.Checks[0].Met {
		t.Fatalf("restarts row %+v", r)
	}
	if r := byCase["slowest replica's"]; r.Figures[1].Stats.Median != 41+58+59 {
		t.Fatalf("delays row %+v", r)
	}

	// One side not run: noted, no ratio charted, no goal for a rekey side absent.
	rows = controllerRows(map[string]*controllerResult{"gardener": gd}, cfg)
	if rows[0].Figures[0].Note != "not run" || len(rows[0].Plots) != 0 {
		t.Fatalf("rekey not run: %+v", rows[0])
	}
}

func TestDelayRangeText(t *testing.T) {
	for _, c := range []struct {
		lo, hi time.Duration
		want   string
	}{{0, time.Minute, "0–60 s"}, {500 * time.Millisecond, 5 * time.Second, "0.5–5 s"}} {
		if got := delayRangeText(c.lo, c.hi); got != c.want {
			t.Errorf("delayRangeText(%v, %v) = %q, want %q", c.lo, c.hi, got, c.want)
		}
	}
}
