package coordination

import (
	"flag"
	"os"
	"regexp"
	"strings"
	"testing"
)

const clusterDoc = "../../docs/cluster.md"

var updateDoc = flag.Bool("update-keys-doc", false, "rewrite the table of coordination keys in "+clusterDoc)

var keysBlock = regexp.MustCompile(`(?s)<!-- coordination keys: begin -->\n(.*?)<!-- coordination keys: end -->`)

// keysTable renders Keys as the Markdown table docs/cluster.md shows.
func keysTable() string {
	var b strings.Builder
	b.WriteString("| Key | Name | Holds | Owner | Lifetime |\n|---|---|---|---|---|\n")
	for _, e := range Keys() {
		b.WriteString("| `" + e.Shape() + "` | " + e.Name + " | " + e.Holds + " | `" + e.Owner + "` | " + string(e.Lifetime) + " |\n")
	}
	return b.String()
}

// TestDocListsEveryKey: docs/cluster.md's table of keys is Keys, and each key has a
// section of its own. Run go test ./pkg/coordination -run TestDocListsEveryKey
// -update-keys-doc after changing the table.
func TestDocListsEveryKey(t *testing.T) {
	doc, err := os.ReadFile(clusterDoc)
	if err != nil {
		t.Fatal(err)
	}
	m := keysBlock.FindSubmatchIndex(doc)
	if m == nil {
		t.Fatalf("%s has no <!-- coordination keys: begin --> ... <!-- coordination keys: end --> block", clusterDoc)
	}
	want := keysTable()
	if *updateDoc {
		doc = append(append(append([]byte{}, doc[:m[2]]...), want...), doc[m[3]:]...)
		if err := os.WriteFile(clusterDoc, doc, 0o644); err != nil {
			t.Fatal(err)
		}
	} else if got := string(doc[m[2]:m[3]]); got != want {
		t.Fatalf("the table of keys in %s is not Keys(); run go test ./pkg/coordination -run TestDocListsEveryKey -update-keys-doc\nwant:\n%s", clusterDoc, want)
	}
	for _, e := range Keys() {
		if !strings.Contains(string(doc), "\n### `<prefix>"+e.Path) {
			t.Errorf("%s has no section on %s: add a heading ### `<prefix>%s...` describing it", clusterDoc, e.Name, e.Path)
		}
	}
}
