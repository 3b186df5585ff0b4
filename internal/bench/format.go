package bench

import (
	"fmt"
	"strings"
)

// How figures are written as text: shared by the progress lines a scenario prints while
// it measures and by the report, so neither depends on the other.

// fmtStat writes a figure's median with its (min–max) spread, in its unit.
func fmtStat(f Figure) string {
	if f.Note != "" {
		return f.Note
	}
	unit := f.Unit
	v := f.Stats
	scale := func(x float64) string {
		switch {
		case unit == "ns/op" && x >= 1e6:
			return fmt.Sprintf("%.2f ms", x/1e6)
		case unit == "ns/op" && x >= 1e3:
			return fmt.Sprintf("%.2f µs", x/1e3)
		case unit == "ns/op":
			return fmt.Sprintf("%.0f ns", x)
		case x >= 100 || x <= -100:
			return fmt.Sprintf("%.0f %s", x, unit)
		case x >= 10 || x <= -10:
			return fmt.Sprintf("%.1f %s", x, unit)
		default:
			return fmt.Sprintf("%.3g %s", x, unit)
		}
	}
	if v.Min == v.Max {
		return scale(v.Median)
	}
	return fmt.Sprintf("%s (%s–%s)", scale(v.Median), strings.TrimSuffix(scale(v.Min), " "+unitSuffix(unit, v.Min)), scale(v.Max))
}

// unitSuffix is the unit fmtStat writes after x.
func unitSuffix(unit string, x float64) string {
	if unit != "ns/op" {
		return unit
	}
	switch {
	case x >= 1e6:
		return "ms"
	case x >= 1e3:
		return "µs"
	default:
		return "ns"
	}
}

// sizeLabel writes a payload size: 256 B, 4 KiB, 1 MiB.
func sizeLabel(n int) string {
	switch {
	case n >= 1<<20:
		return fmt.Sprintf("%d MiB", n>>20)
	case n >= 1<<10:
		return fmt.Sprintf("%d KiB", n>>10)
	default:
		return fmt.Sprintf("%d B", n)
	}
}

// groupThousands writes n with a comma between groups of three digits.
func groupThousands(n int64) string {
	s := fmt.Sprint(n)
	var b strings.Builder
	for i, ch := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(ch)
	}
	return b.String()
}
