package bench

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

// The package keeps helpers, scenarios and rendering apart (see doc.go): a scenario
// file uses helpers and its own scenario's files only; a helper uses no scenario; only
// rendering uses rendering. A file is told by its name below, and any file not named
// is a helper, so a new scenario file fails here until it is listed.
func TestFilesDependOnlyOnHelpers(t *testing.T) {
	scenarioOf := map[string]string{
		"transform.go":         "transform",
		"kms.go":               "kms",
		"reload.go":            "reload",
		"migrate.go":           "migrate",
		"e2e.go":               "e2e",
		"kubeapiserver.go":     "kube-apiserver",
		"rotation.go":          "rotation",
		"rotation_rekey.go":    "rotation",
		"rotation_upstream.go": "rotation",
		"controller.go":        "controller",
		"controller_mgmt.go":   "controller",
		"controller_sides.go":  "controller",
		"scale.go":             "scale",
		"scale_bed.go":         "scale",
		"scale_upstream.go":    "scale",
		"scale_ceiling.go":     "scale",
	}
	rendering := map[string]bool{"report.go": true, "chart.go": true}
	const registry = "scenarios.go" // lists every scenario: may use them all

	paths, err := filepath.Glob("*.go")
	if err != nil {
		t.Fatal(err)
	}
	fset := token.NewFileSet()
	declaredIn := map[string]string{} // package-level name → its file
	uses := map[string][]string{}     // file → names it takes from other files
	for _, p := range paths {
		if strings.HasSuffix(p, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, p, nil, 0)
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range f.Decls {
			switch d := d.(type) {
			case *ast.FuncDecl:
				if d.Recv == nil {
					declaredIn[d.Name.Name] = p
				}
			case *ast.GenDecl:
				for _, s := range d.Specs {
					switch s := s.(type) {
					case *ast.TypeSpec:
						declaredIn[s.Name.Name] = p
					case *ast.ValueSpec:
						for _, n := range s.Names {
							declaredIn[n.Name] = p
						}
					}
				}
			}
		}
		// What the parser cannot resolve within a file is declared in another file of
		// the package, imported, or predeclared.
		for _, id := range f.Unresolved {
			uses[p] = append(uses[p], id.Name)
		}
	}
	var bad []string
	for file, names := range uses {
		for _, name := range names {
			from, ok := declaredIn[name]
			if !ok || from == file {
				continue
			}
			scenario, toScenario := scenarioOf[file], scenarioOf[from]
			var why string
			switch {
			case file == registry:
			case rendering[file]:
				if toScenario != "" {
					why = "rendering uses a scenario"
				}
			case rendering[from]:
				why = "measuring code uses rendering"
			case scenario == "" && toScenario != "":
				why = "a helper uses a scenario"
			case scenario != "" && toScenario != "" && scenario != toScenario:
				why = "a scenario uses another scenario"
			}
			if why != "" {
				bad = append(bad, file+" uses "+name+" from "+from+": "+why)
			}
		}
	}
	slices.Sort(bad)
	bad = slices.Compact(bad)
	for _, b := range bad {
		t.Error(b + " (move what both need into a helper file)")
	}
}
