// Package layertest holds what the tests of the binaries embedding pkg/layer share: the
// layer's flags as a binary with given defaults declares them, and the comparison of
// two flag sets, so that each binary's test can prove its flags are the layer's.
package layertest

import (
	"fmt"
	"sort"

	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/pkg/layer"
)

// Declared is a flag set holding only the layer's flags, declared with d.
func Declared(d layer.Defaults) *pflag.FlagSet {
	fs := pflag.NewFlagSet("layer", pflag.ContinueOnError)
	f := layer.NewFlags(d)
	f.AddFlags(fs)
	return fs
}

// Aspects of a flag Diff compares.
const (
	OnlyInGot  = "only in got"
	OnlyInWant = "only in want"
	Type       = "type"
	Default    = "default"
	Help       = "help"
	Hidden     = "hidden"
)

// Difference is one aspect in which a flag differs between two flag sets.
type Difference struct {
	Flag, Aspect string
	Got, Want    string
}

func (d Difference) String() string {
	if d.Aspect == OnlyInGot || d.Aspect == OnlyInWant {
		return fmt.Sprintf("--%s: %s", d.Flag, d.Aspect)
	}
	return fmt.Sprintf("--%s: %s %q, want %q", d.Flag, d.Aspect, d.Got, d.Want)
}

// Diff lists how got's flags differ from want's: names, types, defaults, help texts and
// hidden-ness, sorted by flag name.
func Diff(got, want *pflag.FlagSet) []Difference {
	var out []Difference
	got.VisitAll(func(g *pflag.Flag) {
		w := want.Lookup(g.Name)
		if w == nil {
			out = append(out, Difference{Flag: g.Name, Aspect: OnlyInGot})
			return
		}
		for _, c := range []struct{ aspect, got, want string }{
			{Type, g.Value.Type(), w.Value.Type()},
			{Default, g.DefValue, w.DefValue},
			{Help, g.Usage, w.Usage},
			{Hidden, fmt.Sprint(g.Hidden), fmt.Sprint(w.Hidden)},
		} {
			if c.got != c.want {
				out = append(out, Difference{Flag: g.Name, Aspect: c.aspect, Got: c.got, Want: c.want})
			}
		}
	})
	want.VisitAll(func(w *pflag.Flag) {
		if got.Lookup(w.Name) == nil {
			out = append(out, Difference{Flag: w.Name, Aspect: OnlyInWant})
		}
	})
	sort.SliceStable(out, func(i, j int) bool { return out[i].Flag < out[j].Flag })
	return out
}
