package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"golang.org/x/text/language"
	"golang.org/x/text/message"

	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// rotateCondition is --if-writes-over and --if-older-than: rotate only when the write
// key has sealed more values than its budget, or is older than its limit (either, when
// both are given), as the cluster's totals in etcd say (cluster.KeyTotal).
type rotateCondition struct {
	writesOver uint64
	olderThan  days
}

func (rc *rotateCondition) addFlags(fs *pflag.FlagSet) {
	fs.Uint64Var(&rc.writesOver, "if-writes-over", 0, "Rotate only if a write key sealed more values than this in the cluster's lifetime (aesgcm: 200000, upstream's guidance for random 96-bit nonces). Needs --etcd-servers.")
	fs.Var(&rc.olderThan, "if-older-than", "Rotate only if a write key was first configured longer ago than this (30d, 12h; d is 24h). With --if-writes-over: either suffices. Needs --etcd-servers.")
}

func (rc rotateCondition) active() bool { return rc.writesOver > 0 || rc.olderThan > 0 }

// days is a duration flag that also reads whole days ("30d").
type days time.Duration

func (d *days) String() string {
	if *d == 0 {
		return ""
	}
	return formatAge(time.Duration(*d))
}

func (d *days) Set(s string) error {
	if n, ok := strings.CutSuffix(s, "d"); ok {
		v, err := strconv.ParseUint(n, 10, 32)
		if err != nil || v == 0 {
			return fmt.Errorf("%q: want a whole number of days (30d) or a Go duration (12h)", s)
		}
		*d = days(time.Duration(v) * 24 * time.Hour)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil || v <= 0 {
		return fmt.Errorf("%q: want a whole number of days (30d) or a positive Go duration (12h)", s)
	}
	*d = days(v)
	return nil
}

func (d *days) Type() string { return "duration" }

// formatAge is "3d" from a day on, else the duration to the second.
func formatAge(d time.Duration) string {
	if d >= 24*time.Hour {
		return fmt.Sprintf("%dd", int(d/(24*time.Hour)))
	}
	return d.Round(time.Second).String()
}

// writeKeyUse is one write key of the rules rotate would rotate, with its total.
type writeKeyUse struct {
	key   transformers.KeyInfo
	total cluster.KeyTotal
	// known is false when no apiserver added the key to the totals yet.
	known bool
}

// decideRotation says whether rc holds for any of keys, and why (or why not), in one
// line per decision.
func decideRotation(rc rotateCondition, keys []writeKeyUse, now time.Time) (bool, string) {
	if len(keys) == 0 {
		return false, "not rotating: no rule to rotate writes with a key (identity has nothing to wear out)"
	}
	var why, whyNot []string
	for _, k := range keys {
		name := k.key.Key
		if !k.known {
			whyNot = append(whyNot, name+" has not been seen by any apiserver yet (no total under the coordination prefix)")
			continue
		}
		age := k.total.Age(now)
		over := rc.writesOver > 0 && k.total.Writes > rc.writesOver
		old := rc.olderThan > 0 && age > time.Duration(rc.olderThan)
		switch {
		case over:
			why = append(why, fmt.Sprintf("%s sealed %s values (budget %s)", name, thousands(k.total.Writes), thousands(rc.writesOver)))
		case old:
			why = append(why, fmt.Sprintf("%s is %s old (limit %s)", name, formatAge(age), formatAge(time.Duration(rc.olderThan))))
		default:
			var parts []string
			if rc.writesOver > 0 {
				parts = append(parts, fmt.Sprintf("sealed %s values, under %s", thousands(k.total.Writes), thousands(rc.writesOver)))
			}
			if rc.olderThan > 0 {
				parts = append(parts, fmt.Sprintf("is %s old, under %s", formatAge(age), formatAge(time.Duration(rc.olderThan))))
			}
			whyNot = append(whyNot, name+" "+strings.Join(parts, ", and "))
		}
	}
	if len(why) > 0 {
		return true, strings.Join(why, "; ") + ": rotating"
	}
	return false, "not rotating: " + strings.Join(whyNot, "; ")
}

// thousands is n with commas: 212,345.
func thousands(n uint64) string { return message.NewPrinter(language.English).Sprintf("%d", n) }

// rotationDue reads the cluster's totals and decides rc for the write keys of the
// rules rotate would change (--resources picks rules).
func (c *common) rotationDue(ctx context.Context, f *rotation.File, rc rotateCondition, prefix string) (bool, string, error) {
	if len(c.etcd.Servers) == 0 {
		return false, "", errors.New("--if-writes-over and --if-older-than need --etcd-servers: the write counts and key ages are the cluster's, in etcd")
	}
	s, err := c.open(ctx, preamble{})
	if err != nil {
		return false, "", err
	}
	defer s.Close()
	prefix = c.coordinationPrefix(prefix)
	totals, err := cluster.ReadKeyTotals(ctx, s.etcd, prefix)
	if err != nil {
		return false, "", err
	}
	snap, err := cluster.ReadSnapshot(ctx, s.etcd, prefix)
	if err != nil {
		return false, "", err
	}
	rotate, why := decideRotation(rc, writeKeysOf(f, c.resources, totals, snap.Members), time.Now())
	return rotate, why, nil
}

// writeKeysOf lists the distinct write keys of f's rules (those naming one of
// resources, when given) with their totals. A KMS v2 key is the key id the live
// members write with, else the one first seen last.
func writeKeysOf(f *rotation.File, resources []string, totals []cluster.KeyTotal, members []cluster.MemberState) []writeKeyUse {
	var picked []string
	for _, r := range resources {
		name, _, _ := strings.Cut(r, "=")
		picked = append(picked, name)
	}
	var out []writeKeyUse
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
		if slices.ContainsFunc(out, func(u writeKeyUse) bool { return u.key == w }) {
			continue
		}
		t, known := cluster.FindKeyTotal(totals, w)
		out = append(out, writeKeyUse{key: w, total: t, known: known})
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
