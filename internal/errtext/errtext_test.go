package errtext

import (
	"errors"
	"fmt"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/util/validation/field"

	"github.com/rekey-io/rekey/pkg/config"
)

func TestBoundedKeepsWholeErrorsAndCountsTheRest(t *testing.T) {
	var errs field.ErrorList
	for i := range 1500 {
		errs = append(errs, field.Invalid(field.NewPath("resources").Index(i), "x", "must be valid"))
	}
	err := fmt.Errorf("reloading /etc/enc.yaml: %w", errs.ToAggregate())
	got := Bounded(err, MaxPublished)
	if len(got) > MaxPublished+len(" (1500 more errors)") {
		t.Fatalf("len = %d, want at most about %d", len(got), MaxPublished)
	}
	if !strings.HasPrefix(got, "reloading /etc/enc.yaml: ") {
		t.Fatalf("the wrapper's words are lost: %q", got[:60])
	}
	var kept int
	if _, err := fmt.Sscanf(got[strings.LastIndex(got, "("):], "(%d more errors)", &kept); err != nil {
		t.Fatalf("no count of the errors left out: %q", got[len(got)-40:])
	}
	if n := strings.Count(got, "must be valid"); n+kept != 1500 {
		t.Fatalf("%d kept + %d counted != 1500", n, kept)
	}
}

func TestBoundedCutsOneLongErrorAtACharacter(t *testing.T) {
	err := errors.New(strings.Repeat("é", 3000)) // 2 bytes a character
	got := Bounded(err, 1001)
	if !strings.HasSuffix(got, "(5000 more bytes)") || !strings.HasPrefix(got, strings.Repeat("é", 500)+" … ") {
		t.Fatalf("got %q…%q", got[:10], got[len(got)-30:])
	}
	if Bounded(errors.New("short"), MaxPublished) != "short" || Bounded(nil, 10) != "" {
		t.Fatal("a short error or nil was changed")
	}
}

func TestBoundedJoined(t *testing.T) {
	err := errors.Join(errors.New(strings.Repeat("a", 600)), errors.New(strings.Repeat("b", 600)), errors.New("c"))
	got := Bounded(err, MaxPublished)
	if got != strings.Repeat("a", 600)+" (2 more errors)" {
		t.Fatalf("got %q", got)
	}
}

// A broken configuration of 80 KB (thousands of bad keys) gives a published error of
// at most about 1 KiB.
func TestBoundedBrokenConfiguration(t *testing.T) {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n")
	for i := 0; b.Len() < 80_000; i++ {
		fmt.Fprintf(&b, "  - resources: [r%d]\n    providers:\n      - aesgcm:\n          keys:\n            - {name: k%d, secret: bad}\n", i, i)
	}
	_, err := config.Parse([]byte(b.String()), "enc.yaml", config.Options{})
	if err == nil {
		t.Fatal("the broken configuration was accepted")
	}
	if len(err.Error()) < 10*MaxPublished {
		t.Fatalf("the raw error is only %d bytes: the test no longer shows a large error", len(err.Error()))
	}
	got := Bounded(err, MaxPublished)
	if len(got) > MaxPublished+40 || !strings.Contains(got, "more error") {
		t.Fatalf("bounded to %d bytes: %q", len(got), got[len(got)-60:])
	}
}

func TestPrintable(t *testing.T) {
	for in, want := range map[string]string{
		"plain text":              "plain text",
		"a\x1b[2Jb":               "a\uFFFD[2Jb",
		"line\nforged: ok":        "line\uFFFDforged: ok",
		"bad \xff byte":           "bad \uFFFD byte",
		"tab\tand\u0085next line": "tab\uFFFDand\uFFFDnext line",
	} {
		if got := Printable(in); got != want {
			t.Errorf("Printable(%q) = %q, want %q", in, got, want)
		}
	}
}
