package fipsenv

import (
	"slices"
	"testing"
)

func TestWithGODEBUG(t *testing.T) {
	got := WithGODEBUG([]string{"A=1", "GODEBUG=x509sha1=1,fips140=only,,http2debug=2", "B=2"}, "off")
	want := []string{"A=1", "B=2", "GODEBUG=fips140=off,x509sha1=1,http2debug=2"}
	if !slices.Equal(got, want) {
		t.Errorf("got %q, want %q", got, want)
	}
	if got := WithGODEBUG([]string{"A=1"}, "only"); !slices.Equal(got, []string{"A=1", "GODEBUG=fips140=only"}) {
		t.Errorf("without GODEBUG: got %q", got)
	}
}
