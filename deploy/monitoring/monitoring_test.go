package monitoring

import (
	"bufio"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

const (
	rulesFile     = "rekey-alerts.yaml"
	dashboardFile = "rekey-dashboard.json"
	docFile       = "../../docs/monitoring.md"
)

// TestRulesParse loads the rules with Prometheus' own loader (which parses every
// expression and template) and checks what an operator needs on each alert.
func TestRulesParse(t *testing.T) {
	groups, errs := loadRules()
	if len(errs) > 0 {
		t.Fatalf("%s does not load: %v", rulesFile, errs)
	}
	doc, err := os.ReadFile(docFile)
	if err != nil {
		t.Fatal(err)
	}
	anchors := headingAnchors(string(doc))
	n := 0
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert == "" {
				t.Errorf("group %s: a recording rule %q; the pack has alerts only", g.Name, r.Record)
				continue
			}
			n++
			if s := r.Labels["severity"]; s != "warning" && s != "critical" {
				t.Errorf("%s: severity %q, want warning or critical", r.Alert, s)
			}
			for _, a := range []string{"summary", "description", "runbook"} {
				if r.Annotations[a] == "" {
					t.Errorf("%s: no %s annotation", r.Alert, a)
				}
			}
			anchor := "docs/monitoring.md#" + strings.ToLower(r.Alert)
			if r.Annotations["runbook"] != anchor {
				t.Errorf("%s: runbook %q, want %q", r.Alert, r.Annotations["runbook"], anchor)
			}
			if !anchors[strings.ToLower(r.Alert)] {
				t.Errorf("%s: docs/monitoring.md has no section named after it", r.Alert)
			}
			if !strings.Contains(r.Annotations["description"], "docs/") {
				t.Errorf("%s: the description points to no documentation", r.Alert)
			}
		}
	}
	if n == 0 {
		t.Fatalf("%s has no alert", rulesFile)
	}
}

// loadRules loads the rules file as Prometheus does (unknown fields are errors; every
// name rekey exports fits the legacy name scheme).
func loadRules() (*rulefmt.RuleGroups, []error) {
	return rulefmt.ParseFile(rulesFile, false, model.LegacyValidation, parser.NewParser(parser.Options{}), slog.New(slog.DiscardHandler))
}

// headingAnchors are the GitHub-style anchors of the markdown headings that consist of
// one word (the alert names).
func headingAnchors(md string) map[string]bool {
	out := map[string]bool{}
	for _, line := range strings.Split(md, "\n") {
		if h, ok := strings.CutPrefix(line, "### "); ok {
			out[strings.ToLower(strings.Trim(strings.TrimSpace(h), "`"))] = true
		}
	}
	return out
}

// grafanaVars are Grafana's built-in interval variables, replaced by a duration so the
// PromQL parser accepts a panel's query as Prometheus will receive it.
var grafanaVars = strings.NewReplacer("$__rate_interval", "5m", "$__interval", "1m", "$__range", "1h")

// labelValues is Grafana's template-variable query label_values(<selector>, <label>).
var labelValues = regexp.MustCompile(`^label_values\((.*),\s*[a-zA-Z_][a-zA-Z0-9_]*\)$`)

type dashboard struct {
	Panels []struct {
		Title      string `json:"title"`
		Type       string `json:"type"`
		Datasource struct {
			UID string `json:"uid"`
		} `json:"datasource"`
		Targets []struct {
			Expr string `json:"expr"`
		} `json:"targets"`
	} `json:"panels"`
	Templating struct {
		List []struct {
			Name  string `json:"name"`
			Type  string `json:"type"`
			Query any    `json:"query"`
		} `json:"list"`
	} `json:"templating"`
}

// queries returns every PromQL query of the rules file and the dashboard, keyed by
// where it is, after checking that each parses.
func queries(t *testing.T) map[string]string {
	t.Helper()
	out := map[string]string{}
	groups, errs := loadRules()
	if len(errs) > 0 {
		t.Fatalf("%s does not load: %v", rulesFile, errs)
	}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			out[rulesFile+": "+r.Alert+r.Record] = r.Expr
		}
	}
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	for _, p := range d.Panels {
		if p.Type == "row" {
			continue
		}
		if p.Datasource.UID != "${datasource}" {
			t.Errorf("%s: panel %q: datasource %q, want the ${datasource} variable", dashboardFile, p.Title, p.Datasource.UID)
		}
		if len(p.Targets) == 0 {
			t.Errorf("%s: panel %q has no query", dashboardFile, p.Title)
		}
		for i, tg := range p.Targets {
			out[fmt.Sprintf("%s: panel %q query %d", dashboardFile, p.Title, i)] = grafanaVars.Replace(tg.Expr)
		}
	}
	hasDatasource := false
	for _, v := range d.Templating.List {
		switch v.Type {
		case "datasource":
			hasDatasource = v.Name == "datasource"
		case "query":
			q, _ := v.Query.(map[string]any)
			s, _ := q["query"].(string)
			m := labelValues.FindStringSubmatch(s)
			if m == nil {
				t.Errorf("%s: variable %s: query %q is not label_values(selector, label)", dashboardFile, v.Name, s)
				continue
			}
			out[fmt.Sprintf("%s: variable %s", dashboardFile, v.Name)] = m[1]
		}
	}
	if !hasDatasource {
		t.Errorf("%s: no datasource template variable named datasource", dashboardFile)
	}
	return out
}

// metricNames returns the metric names expr selects, from the PromQL syntax tree.
func metricNames(expr string) ([]string, error) {
	e, err := parser.NewParser(parser.Options{}).ParseExpr(expr)
	if err != nil {
		return nil, err
	}
	var names []string
	parser.Inspect(e, func(n parser.Node, _ []parser.Node) error {
		vs, ok := n.(*parser.VectorSelector)
		if !ok {
			return nil
		}
		name := vs.Name
		for _, m := range vs.LabelMatchers {
			if m.Name == model.MetricNameLabel && m.Type == labels.MatchEqual {
				name = m.Value
			}
		}
		if name != "" {
			names = append(names, name)
		}
		return nil
	})
	return names, nil
}

// usedMetrics maps every metric name the pack uses to where it is used.
func usedMetrics(t *testing.T) map[string][]string {
	t.Helper()
	used := map[string][]string{}
	for where, q := range queries(t) {
		names, err := metricNames(q)
		if err != nil {
			t.Errorf("%s: %v", where, err)
			continue
		}
		if len(names) == 0 {
			t.Errorf("%s: selects no metric", where)
		}
		for _, n := range names {
			used[n] = append(used[n], where)
		}
	}
	return used
}

func TestQueriesParse(t *testing.T) {
	if len(usedMetrics(t)) == 0 {
		t.Fatal("the pack uses no metric")
	}
}

// exposition is what /metrics declared: family types (from # TYPE lines, present for
// every registered family with a series) and the sample names seen.
type exposition struct {
	types   map[string]string
	samples map[string]bool
}

func newExposition() *exposition {
	return &exposition{types: map[string]string{}, samples: map[string]bool{}}
}

func (e *exposition) add(r io.Reader) error {
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	for sc.Scan() {
		line := sc.Text()
		if rest, ok := strings.CutPrefix(line, "# TYPE "); ok {
			if f := strings.Fields(rest); len(f) == 2 {
				e.types[f[0]] = f[1]
			}
			continue
		}
		if rest, ok := strings.CutPrefix(line, "# HELP "); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				if _, seen := e.types[f[0]]; !seen {
					e.types[f[0]] = "untyped"
				}
			}
			continue
		}
		if line == "" || line[0] == '#' {
			continue
		}
		if i := strings.IndexAny(line, "{ "); i > 0 {
			e.samples[line[:i]] = true
		}
	}
	return sc.Err()
}

// exposes reports whether name is a family or a series /metrics declared; a
// histogram's _bucket, _count and _sum count when the histogram is declared.
func (e *exposition) exposes(name string) bool {
	if e.samples[name] {
		return true
	}
	if _, ok := e.types[name]; ok {
		return true
	}
	for _, suffix := range []string{"_bucket", "_count", "_sum"} {
		if base, ok := strings.CutSuffix(name, suffix); ok {
			if typ := e.types[base]; typ == "histogram" || (typ == "summary" && suffix != "_bucket") {
				return true
			}
		}
	}
	return false
}

// missing lists the used metrics e does not expose, with where each is used.
func (e *exposition) missing(used map[string][]string) []string {
	var out []string
	for name, where := range used {
		if !e.exposes(name) {
			sort.Strings(where)
			out = append(out, fmt.Sprintf("%s (used in %s)", name, strings.Join(where, "; ")))
		}
	}
	sort.Strings(out)
	return out
}

// TestMissingNamesAMisspeltMetric: the check itself catches a name no exporter serves,
// including a histogram suffix on a gauge.
func TestMissingNamesAMisspeltMetric(t *testing.T) {
	e := newExposition()
	if err := e.add(strings.NewReader(`# HELP rekey_cluster_members Live apiservers.
# TYPE rekey_cluster_members gauge
rekey_cluster_members 3
# HELP some_latency_seconds A histogram with no series yet.
# TYPE some_latency_seconds histogram
`)); err != nil {
		t.Fatal(err)
	}
	for _, expr := range []string{
		`rekey_cluster_members > 1`,
		`histogram_quantile(0.9, rate(some_latency_seconds_bucket[5m]))`,
		`rate(some_latency_seconds_count[5m])`,
	} {
		names, err := metricNames(expr)
		if err != nil {
			t.Fatal(err)
		}
		if m := e.missing(map[string][]string{names[0]: {expr}}); len(m) > 0 {
			t.Errorf("%s: reported missing: %v", expr, m)
		}
	}
	for _, expr := range []string{
		`rekey_cluster_member > 1`,
		`{__name__="rekey_clustr_members"}`,
		`rate(rekey_cluster_members_count[5m])`,
	} {
		names, err := metricNames(expr)
		if err != nil {
			t.Fatal(err)
		}
		if m := e.missing(map[string][]string{names[0]: {expr}}); len(m) != 1 {
			t.Errorf("%s: missing = %v, want the misspelt name", expr, m)
		}
	}
}

// TestEveryMetricIsExposedByARunningShim starts a KMS v2 plugin and two apiserver shims
// on one etcd, drives them through what makes rekey's lazily created series appear —
// Secret and ConfigMap writes and reads (KMS and local-key transformations), a reload,
// a write key held back by the fence while the other apiserver lacks it, a storage
// migration — and checks that every metric a rule or panel uses was on /metrics.
func TestEveryMetricIsExposedByARunningShim(t *testing.T) {
	if testing.Short() {
		t.Skip("starts etcd, a KMS plugin and two apiserver shims")
	}
	used := usedMetrics(t)
	if t.Failed() {
		t.FailNow()
	}
	ctx := t.Context()
	dir := t.TempDir()
	bins := build(t, filepath.Join(dir, "bin"))
	etcd, err := testbed.StartEtcd(ctx, bins.Etcd, dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { etcd.Stop(10 * time.Second) })
	sockDir, err := os.MkdirTemp("", "rekey-mon-")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(sockDir) })
	plugin, err := testbed.StartPlugin(ctx, bins.Plugin, dir, sockDir, testbed.PluginKey{Name: "kek-1", Secret: testbed.RandomKey()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { plugin.Stop(5 * time.Second) })

	k1 := testbed.NamedKey{Name: "k1", Secret: testbed.RandomKey()}
	k2 := testbed.NamedKey{Name: "k2", Secret: testbed.RandomKey()}
	config := func(configmapKeys ...testbed.NamedKey) []byte {
		return testbed.EncryptionConfig{
			{Resources: []string{"secrets"}, Providers: []testbed.Provider{testbed.KMSv2("kms-1", plugin.Endpoint), testbed.Identity()}},
			{Resources: []string{"configmaps"}, Providers: []testbed.Provider{testbed.AESGCM(configmapKeys...), testbed.Identity()}},
		}.Render()
	}
	fleet, err := testbed.StartFleet(ctx, testbed.FleetConfig{
		ShimBin: bins.Shim, Dir: dir, N: 2, EtcdServers: []string{etcd.Endpoint},
		Config: config(k1), SyncMode: testbed.SyncRename,
		Args: []string{"--cluster-lease-ttl", "2s", "--storage-migration-check-interval", "250ms",
			"--kms-status-interval", "1s", "--storage-migration-rate", "20"},
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("logs:\n%s", fleet.LogTails(3000))
		}
		fleet.Stop()
	})
	a, b := fleet.Shims[0], fleet.Shims[1]

	seen := newExposition()
	var mu sync.Mutex
	scrape := func() error {
		for _, s := range fleet.Shims {
			shim := s.Current()
			hc, err := shim.HTTPClient(true)
			if err != nil {
				return err
			}
			resp, err := hc.Get(shim.URL + "/metrics")
			if err != nil {
				return err
			}
			mu.Lock()
			err = seen.add(resp.Body)
			mu.Unlock()
			resp.Body.Close()
			if err == nil && resp.StatusCode != 200 {
				err = fmt.Errorf("%s/metrics: %s", shim.URL, resp.Status)
			}
			if err != nil {
				return err
			}
		}
		return nil
	}
	// Some series live only while something is under way (a held fence, a running
	// migration's progress): scrape both apiservers all along.
	stop := make(chan struct{})
	var scrapeErr error
	var wg sync.WaitGroup
	wg.Go(func() {
		for {
			if err := scrape(); err != nil && ctx.Err() == nil {
				mu.Lock()
				scrapeErr = err
				mu.Unlock()
			}
			select {
			case <-stop:
				return
			case <-time.After(100 * time.Millisecond):
			}
		}
	})
	defer func() { close(stop); wg.Wait() }()

	cli, err := a.Client()
	if err != nil {
		t.Fatal(err)
	}
	const ns = "default"
	for i := range 5 {
		if _, err := cli.CoreV1().Secrets(ns).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s-%d", i)},
			StringData: map[string]string{"v": "x"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	for i := range 120 {
		if _, err := cli.CoreV1().ConfigMaps(ns).Create(ctx, &corev1.ConfigMap{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("c-%d", i)},
			Data: map[string]string{"v": "x"}}, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}
	if _, err := cli.CoreV1().Secrets(ns).List(ctx, metav1.ListOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.CoreV1().ConfigMaps(ns).Get(ctx, "c-0", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}

	// A new write key for configmaps on a only: a reloads and holds k2 until b can read it.
	if err := testbed.WriteFileAtomic(a.ConfigPath, config(k2, k1)); err != nil {
		t.Fatal(err)
	}
	waitFor(t, 30*time.Second, "a holds k2 back (rekey_cluster_fence_held_seconds)", func() bool {
		mu.Lock()
		defer mu.Unlock()
		return seen.samples["rekey_cluster_fence_held_seconds"]
	})
	if err := testbed.WriteFileAtomic(b.ConfigPath, config(k2, k1)); err != nil {
		t.Fatal(err)
	}
	// Then the elected apiserver migrates 120 ConfigMaps at 20/s: its progress series
	// (updated every second) lives for about 6 s. The objects by key come from an
	// inventory that saw the ConfigMaps: the leader's verifying re-scan, which both
	// apiservers take for theirs once it is recorded (none scans while it migrates).
	waitFor(t, 60*time.Second, "the migration's progress and results", func() bool {
		mu.Lock()
		defer mu.Unlock()
		// remaining_objects is set once a page is done; a transaction carries 50 ms of the
		// rate (one object at 20/s), so objects_total appears well before it.
		return seen.samples["rekey_cluster_migration_objects"] && seen.samples["rekey_storage_migration_objects_total"] &&
			seen.samples["rekey_storage_migration_remaining_objects"] && seen.samples["rekey_storage_objects"]
	})
	if err := scrape(); err != nil {
		t.Fatal(err)
	}
	mu.Lock()
	defer mu.Unlock()
	if scrapeErr != nil {
		t.Errorf("scraping /metrics: %v", scrapeErr)
	}
	for _, m := range seen.missing(used) {
		t.Errorf("not on a running apiserver-shim's /metrics: %s", m)
	}
	t.Logf("%d metric names used by the pack, all served", len(used))
}

func waitFor(t *testing.T, timeout time.Duration, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out after %v waiting for %s", timeout, what)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// build compiles the shim, the etcd wrapper and the KMS plugin from rekey's module (two
// directories up: testbed.Build looks for the module of the working directory, which
// here is this one).
func build(t *testing.T, dir string) testbed.Binaries {
	t.Helper()
	root, err := filepath.Abs("../..")
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.CommandContext(t.Context(), "go", "build", "-ldflags", testbed.VersionLDFlags, "-o", dir+string(filepath.Separator),
		"./cmd/apiserver-shim", "./hack/tools/etcd", "./cmd/kms-plugin")
	cmd.Dir = root
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return testbed.Binaries{
		Shim:   filepath.Join(dir, "apiserver-shim"),
		Etcd:   filepath.Join(dir, "etcd"),
		Plugin: filepath.Join(dir, "kms-plugin"),
	}
}
