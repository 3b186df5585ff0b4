package rotation

import (
	"fmt"
	"slices"
	"strings"
	"time"

	"golang.org/x/text/language"
	"golang.org/x/text/message"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Condition is `rekey rotate --if-writes-over --if-older-than`: rotate only when a
// write key has sealed more values than WritesOver, or is older than OlderThan (either,
// when both are set), as the cluster's totals in etcd say (cluster.KeyTotal). Zero
// leaves a bound out.
type Condition struct {
	WritesOver uint64
	OlderThan  time.Duration
}

// Active reports whether any bound is set.
func (c Condition) Active() bool { return c.WritesOver > 0 || c.OlderThan > 0 }

// KeyUse is one write key of the rules rotate would rotate, with the cluster's total
// of its writes.
type KeyUse struct {
	Key   transformers.KeyInfo
	Total cluster.KeyTotal
	// Known is false when no apiserver added the key to the totals yet.
	Known bool
}

// Due says whether c holds for any of keys, and why (or why not), in one line per
// decision. It reads no clock and no etcd: the caller passes what the cluster's
// records say (WriteKeys) and the time.
func (c Condition) Due(keys []KeyUse, now time.Time) (bool, string) {
	if len(keys) == 0 {
		return false, "not rotating: no rule to rotate writes with a key (identity has nothing to wear out)"
	}
	var why, whyNot []string
	for _, k := range keys {
		name := k.Key.Key
		if !k.Known {
			whyNot = append(whyNot, name+" has not been seen by any apiserver yet (no total under the coordination prefix)")
			continue
		}
		age := k.Total.Age(now)
		over := c.WritesOver > 0 && k.Total.Writes > c.WritesOver
		old := c.OlderThan > 0 && age > c.OlderThan
		switch {
		case over:
			why = append(why, fmt.Sprintf("%s sealed %s values (budget %s)", name, Thousands(k.Total.Writes), Thousands(c.WritesOver)))
		case old:
			why = append(why, fmt.Sprintf("%s is %s old (limit %s)", name, FormatAge(age), FormatAge(c.OlderThan)))
		default:
			var parts []string
			if c.WritesOver > 0 {
				parts = append(parts, fmt.Sprintf("sealed %s values, under %s", Thousands(k.Total.Writes), Thousands(c.WritesOver)))
			}
			if c.OlderThan > 0 {
				parts = append(parts, fmt.Sprintf("is %s old, under %s", FormatAge(age), FormatAge(c.OlderThan)))
			}
			whyNot = append(whyNot, name+" "+strings.Join(parts, ", and "))
		}
	}
	if len(why) > 0 {
		return true, strings.Join(why, "; ") + ": rotating"
	}
	return false, "not rotating: " + strings.Join(whyNot, "; ")
}

// WriteKeys lists the distinct write keys of f's rules (those naming one of
// resources, when given, as --resources names them) with their totals. A KMS v2 key
// is the key id the live members write with, else the one first seen last.
func WriteKeys(f *File, resources []string, totals []cluster.KeyTotal, members []cluster.MemberState) []KeyUse {
	var picked []string
	for _, r := range resources {
		name, _, _ := strings.Cut(r, "=")
		picked = append(picked, name)
	}
	var out []KeyUse
	for _, rule := range transformers.DescribeRules(f.Config) {
		if len(picked) > 0 && !slices.Contains(picked, rule.Resource) {
			continue
		}
		w, ok := rule.Writer()
		if !ok || w.Provider == transformers.ProviderIdentity {
			continue
		}
		if w.Provider == transformers.ProviderKMSv2 {
			w.KeyIDHash = kmsWriteKeyID(w.Key, totals, members)
		}
		if slices.ContainsFunc(out, func(u KeyUse) bool { return u.Key == w }) {
			continue
		}
		t, known := cluster.FindKeyTotal(totals, w)
		out = append(out, KeyUse{Key: w, Total: t, Known: known})
	}
	return out
}

func kmsWriteKeyID(name string, totals []cluster.KeyTotal, members []cluster.MemberState) string {
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Write.Provider == transformers.ProviderKMSv2 && r.Write.Key == name && r.Write.KeyIDHash != "" {
				return r.Write.KeyIDHash
			}
		}
	}
	var latest cluster.KeyTotal
	for _, t := range totals {
		if t.Provider == transformers.ProviderKMSv2 && t.Key.Key == name && t.FirstSeen.After(latest.FirstSeen) {
			latest = t
		}
	}
	return latest.KeyIDHash
}

// FormatAge is a key's age as rekey prints it: "3d" from a day on, else the duration
// to the second.
func FormatAge(d time.Duration) string {
	if d >= 24*time.Hour {
		return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
	}
	return d.Round(time.Second).String()
}

// Thousands is n with commas: 212,345.
func Thousands(n uint64) string { return message.NewPrinter(language.English).Sprintf("%d", n) }
