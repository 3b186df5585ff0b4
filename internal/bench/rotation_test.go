package bench

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"
)

// The id label ends in hash=" too: only the hash label counts, wherever it stands.
func TestParseConfigHashes(t *testing.T) {
	body := []byte(`# HELP apiserver_encryption_config_controller_last_config_info Information about the last applied encryption configuration with hash as label, split by apiserver identity.
# TYPE apiserver_encryption_config_controller_last_config_info gauge
apiserver_encryption_config_controller_last_config_info{apiserver_id_hash="sha256:1111",hash="sha256:aaaa"} 1
apiserver_encryption_config_controller_last_config_info{hash="sha256:bbbb",apiserver_id_hash="sha256:2222"} 1
apiserver_encryption_config_controller_automatic_reloads_total{apiserver_id_hash="sha256:1111",status="success"} 2
`)
	got := parseConfigHashes(body)
	if want := []string{"sha256:aaaa", "sha256:bbbb"}; !reflect.DeepEqual(got, want) {
		t.Fatalf("parseConfigHashes = %v, want %v", got, want)
	}
	if got := parseConfigHashes([]byte("apiserver_encryption_config_controller_automatic_reloads_total 1\n")); len(got) != 0 {
		t.Fatalf("hashes from a body without the metric: %v", got)
	}
}

func TestRotateHelpHasWait(t *testing.T) {
	with := "Flags:\n      --etcd-servers strings   etcd servers\n      --wait                   Follow the cluster\n"
	without := "Flags:\n      --etcd-servers strings   etcd servers\n      --wait-timeout duration  not the flag\n  -o, --output string   waits for --wait\n"
	if !rotateHelpHasWait(with) {
		t.Error("--wait not found in a help text that lists it")
	}
	if rotateHelpHasWait(without) {
		t.Error("--wait found in a help text that only mentions it")
	}
}

// The scenario takes minutes, so the default run leaves it out; naming it runs it.
func TestSelectLeavesExplicitScenariosOut(t *testing.T) {
	def, err := Select(nil)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range def {
		if s.Name == "rotation" {
			t.Fatal("the default run includes the rotation scenario")
		}
	}
	named, err := Select([]string{"rotation"})
	if err != nil || len(named) != 1 || named[0].Name != "rotation" {
		t.Fatalf("Select(rotation) = %v, %v", named, err)
	}
}

func TestRotationRows(t *testing.T) {
	rk := &rotationResult{side: "rekey", total: 20 * time.Second, afterLastFile: 12 * time.Second, edits: 2,
		underNew: 10_100, stored: 10_100, newKey: "key-2026"}
	up := &rotationResult{side: "upstream", total: 200 * time.Second, afterLastFile: 190 * time.Second, edits: 3,
		underNew: 10_090, stored: 10_100, newKey: "key2", rewritten: 10_050}
	rows := rotationRows(map[string]*rotationResult{"rekey": rk, "upstream": up}, 10_000)
	if rows[0].Scenario != rotationScenario {
		t.Fatalf("scenario %q", rows[0].Scenario)
	}
	total := rows[0]
	if sp := total.Speedup(1); sp != 10 {
		t.Fatalf("speedup %v, want 10", sp)
	}
	if len(total.Checks) != 1 || !total.Checks[0].Met || len(total.Plots) != 1 {
		t.Fatalf("total row: checks %+v, plots %+v", total.Checks, total.Plots)
	}
	if c := rows[1].Checks; len(c) != 1 || !c[0].Met {
		t.Fatalf("< 60 s check: %+v", c)
	}
	var under Row
	for _, r := range rows {
		if strings.HasPrefix(r.Case, "stored Secrets under the new key") {
			under = r
		}
	}
	// upstream left 10 Secrets on the old key: that is a miss, and says so.
	var missed []string
	for _, c := range under.Checks {
		if !c.Met {
			missed = append(missed, c.Desc+" "+c.Got)
		}
	}
	if want := []string{"upstream: every stored Secret 10090 of 10100"}; !reflect.DeepEqual(missed, want) {
		t.Fatalf("missed %v, want %v", missed, want)
	}
	if got := under.Figures[1].Stats.Median; got < 99.89 || got > 99.91 {
		t.Fatalf("upstream's share under the new key %.2f%%, want 99.90%%", got)
	}

	// Side (a) not run: its figures say so, and there is no ratio to chart or check.
	upDone := *up
	upDone.underNew = upDone.stored
	only := rotationRows(map[string]*rotationResult{"upstream": &upDone}, 1_000)
	if !strings.Contains(only[0].Scenario, "1,000 Secrets") {
		t.Fatalf("scenario %q does not name 1,000 Secrets", only[0].Scenario)
	}
	if only[0].Figures[0].Note != "not run" || len(only[0].Plots) != 0 || len(only[0].Checks) != 0 {
		t.Fatalf("upstream-only total row: %+v", only[0])
	}
	r := &Report{Rows: only}
	if r.Missed() != 0 {
		t.Fatalf("an upstream-only run reports %d misses", r.Missed())
	}
}

// A scenario measured alone replaces its own rows and keeps every other scenario's,
// each with the run that measured it.
func TestMergeKeepsOtherScenarios(t *testing.T) {
	old := sampleReport()
	otherHost := old.Host
	otherHost.CPU = "Intel Xeon"
	rotationRun := &Report{Command: "rekey-bench -scenarios rotation", Started: old.Started.Add(48 * time.Hour), Host: otherHost,
		Rows: rotationRows(map[string]*rotationResult{"rekey": {total: time.Second, afterLastFile: time.Second, stored: 1, underNew: 1},
			"upstream": {total: 9 * time.Second, afterLastFile: 8 * time.Second, stored: 1, underNew: 1}}, 10_000)}
	merged := rotationRun.Merge(old)
	if got, want := merged.scenarios(), append(old.scenarios(), rotationScenario); !slices.Equal(got, want) {
		t.Fatalf("scenarios %v, want %v", got, want)
	}
	if merged.Command != old.Command || !merged.Started.Equal(old.Started) {
		t.Fatalf("merged run %q %v, want the first scenario's %q %v", merged.Command, merged.Started, old.Command, old.Started)
	}
	if merged.Host != old.Host {
		t.Fatalf("merged header host %+v, want the main run's %+v", merged.Host, old.Host)
	}
	if ri, ok := merged.ScenarioRuns[rotationScenario]; !ok || ri.Command != rotationRun.Command || ri.Host != otherHost {
		t.Fatalf("rotation's run: %+v", merged.ScenarioRuns)
	}
	if len(merged.ScenarioRuns) != 1 {
		t.Fatalf("runs of scenarios measured by the main run recorded apart: %+v", merged.ScenarioRuns)
	}
	if !reflect.DeepEqual(merged.rowsOf("transform"), old.rowsOf("transform")) {
		t.Fatal("merging changed another scenario's rows")
	}
	var md bytes.Buffer
	merged.WriteMarkdown(&md, "")
	if !strings.Contains(md.String(), "Command: `rekey-bench -scenarios rotation`") {
		t.Fatalf("the markdown does not name the rotation's own run:\n%s", md.String())
	}

	// Measuring it again replaces it in place, and the JSON round trip keeps the runs.
	again := &Report{Command: "rekey-bench -scenarios rotation -rotation-objects 10000", Started: old.Started.Add(72 * time.Hour),
		Rows: rotationRun.Rows[:1]}
	var buf bytes.Buffer
	if err := merged.WriteJSON(&buf); err != nil {
		t.Fatal(err)
	}
	back, err := ReadReport(&buf)
	if err != nil {
		t.Fatal(err)
	}
	twice := again.Merge(back)
	if n := len(twice.rowsOf(rotationScenario)); n != 1 {
		t.Fatalf("%d rotation rows after the second merge, want 1", n)
	}
	if ri := twice.ScenarioRuns[rotationScenario]; ri.Command != again.Command {
		t.Fatalf("rotation's run after the second merge: %+v", ri)
	}
}

// The clients' requests are summarised per window and per sender and verb: those
// answered during the rewrite count during the rotation and in the rewrite window,
// those answered after the rotation nowhere; the p99 during the rotation is checked
// on rekey's side against 1.5 × before, upstream's reported beside it.
func TestRotationClientLatencies(t *testing.T) {
	c := newClientLatencies()
	sampler, writers := c.observer("sampler"), c.observer("writers")
	for i := range 100 {
		sampler("get", time.Duration(i+1)*time.Millisecond) // 1..100 ms
		writers("update", 10*time.Millisecond)
	}
	for range 5 {
		writers("create", 20*time.Millisecond)
	}
	c.enter(windowDuring)
	for i := range 100 {
		sampler("get", time.Duration(i+1)*time.Millisecond) // 1..100 ms
	}
	c.rewrite(true)
	for i := range 100 {
		sampler("get", time.Duration(i+101)*time.Millisecond) // 101..200 ms
	}
	c.rewrite(false)
	writers("create", 30*time.Millisecond)
	c.enter("")
	sampler("get", time.Hour)
	got := c.summaries()
	// Every request recorded in a window is in the ops file once, with its window (the
	// rewrite's for those answered during it); the one after the rotation is not.
	opsPath := filepath.Join(t.TempDir(), "rekey-client-ops.csv")
	if err := c.writeOps(opsPath); err != nil {
		t.Fatal(err)
	}
	raw, err := os.ReadFile(opsPath)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(strings.TrimSpace(string(raw)), "\n")
	perWindow := map[string]int{}
	for _, l := range lines[1:] {
		perWindow[strings.Split(l, ",")[1]]++
	}
	if lines[0] != "answeredAt,window,requests,latencyMs" || len(lines) != 1+406 ||
		perWindow[windowBefore] != 205 || perWindow[windowDuring] != 101 || perWindow[windowRewrite] != 100 {
		t.Errorf("ops file: %d lines, per window %v; want a header and 205 before, 101 during, 100 rewrite", len(lines), perWindow)
	}
	want := []latencySummary{
		{Window: windowBefore, Requests: "sampler get", N: 100, P50ms: 50, P99ms: 99},
		{Window: windowBefore, Requests: "writers create", N: 5, P50ms: 20, P99ms: 20},
		{Window: windowBefore, Requests: "writers update", N: 100, P50ms: 10, P99ms: 10},
		{Window: windowDuring, Requests: "sampler get", N: 200, P50ms: 100, P99ms: 198},
		{Window: windowDuring, Requests: "writers create", N: 1, P50ms: 30, P99ms: 30},
		{Window: windowRewrite, Requests: "sampler get", N: 100, P50ms: 150, P99ms: 199},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("summaries\n%+v\nwant\n%+v", got, want)
	}
	if text := latencyText(got); !strings.Contains(text, "sampler get: p50 50.0 ms, p99 99.0 ms before (n 100); p50 100.0 ms, p99 198.0 ms during (n 200); p50 150.0 ms, p99 199.0 ms rewrite (n 100); p99 ×2.00") {
		t.Errorf("text:\n%s", text)
	}

	up := append([]latencySummary(nil), got...)
	up[3].P99ms = 400
	rows := rotationRows(map[string]*rotationResult{
		"rekey":    {side: "rekey", clients: got},
		"upstream": {side: "upstream", clients: up},
	}, 10_000)
	byCase := map[string]Row{}
	for _, r := range rows {
		byCase[r.Case] = r
	}
	r, ok := byCase["clients' p99, sampler get, during the rotation"]
	if !ok {
		t.Fatalf("no row of the sampler's p99 during the rotation among %d rows", len(rows))
	}
	if r.Figures[0].Stats.Median != 198 || r.Figures[1].Stats.Median != 400 || r.Figures[0].Unit != "ms" {
		t.Errorf("figures %+v", r.Figures)
	}
	if len(r.Checks) != 1 || r.Checks[0].Met || r.Checks[0].Got != "99.0 → 198.0 ms, ×2.00; upstream 99.0 → 400.0 ms, ×4.04" {
		t.Errorf("checks %+v: rekey's ×2 is over the 1.5× bound", r.Checks)
	}
	if r := byCase["clients' p99, sampler get, during the rewrite"]; r.Figures[0].Stats.Median != 199 || len(r.Checks) != 0 {
		t.Errorf("the sampler's p99 during the rewrite: %+v (reported, not checked)", r)
	}
	if r := byCase["clients' p99, writers update, during the rotation"]; r.Figures[0].Note != "no such request" || len(r.Checks) != 0 {
		t.Errorf("a kind without requests during the rotation: %+v", r)
	}
	// Five creates before and one during: a p99 of so few is their slowest, reported
	// and not judged (×1.5 over 20 ms would be missed).
	if r := byCase["clients' p99, writers create, during the rotation"]; r.Figures[0].Stats.Median != 30 || len(r.Checks) != 0 {
		t.Errorf("writers' creates during the rotation: %+v (too few to judge)", r)
	}
}
