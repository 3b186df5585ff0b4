package monitoring

import (
	"os"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/prometheus/prometheus/promql/promqltest"
)

// placeholder is ${AlertName} in testdata/alerts.promqltest.
var placeholder = regexp.MustCompile(`\$\{([A-Za-z]+)\}`)

// TestAlertsFireOnlyWhenTheyShould evaluates every alert's expression with Prometheus'
// engine against the made-up series of testdata/alerts.promqltest: which series fire,
// with which labels and values, and which must not.
func TestAlertsFireOnlyWhenTheyShould(t *testing.T) {
	groups, errs := loadRules()
	if len(errs) > 0 {
		t.Fatalf("%s does not load: %v", rulesFile, errs)
	}
	exprs := map[string]string{}
	for _, g := range groups.Groups {
		for _, r := range g.Rules {
			if r.Alert != "" {
				// The script language wants a query on one line; PromQL does not mind.
				exprs[r.Alert] = strings.Join(strings.Fields(r.Expr), " ")
			}
		}
	}
	b, err := os.ReadFile("testdata/alerts.promqltest")
	if err != nil {
		t.Fatal(err)
	}
	tested := map[string]bool{}
	script := placeholder.ReplaceAllStringFunc(string(b), func(m string) string {
		name := placeholder.FindStringSubmatch(m)[1]
		e, ok := exprs[name]
		if !ok {
			t.Errorf("testdata/alerts.promqltest: no alert named %s in %s", name, rulesFile)
			return m
		}
		tested[name] = true
		return e
	})
	for name := range exprs {
		if !tested[name] {
			t.Errorf("%s: no case in testdata/alerts.promqltest", name)
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	promqltest.RunTest(t, script, promqltest.NewTestEngine(t, false, 5*time.Minute, 1e6))
}
