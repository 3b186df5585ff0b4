package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// writeKeyWritesTable prints the cluster's lifetime write count and age of every key
// (cluster.KeyTotal) and which of them a live member writes with now. Every value is
// text read from etcd, so it goes out through row and printLine only.
func writeKeyWritesTable(w io.Writer, totals []cluster.KeyTotal, members []cluster.MemberState, now time.Time) {
	if len(totals) == 0 {
		return
	}
	fmt.Fprintln(w)
	printLine(w, "KEY WRITES (every apiserver's, over the cluster's lifetime)")
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	row(tw, "KEY", "CHECK", "WRITES", "AGE", "WRITING")
	for _, t := range totals {
		check := t.Check
		if check == "" {
			check = t.KeyIDHash
		}
		row(tw, t.Provider+"/"+t.Key.Key, shortHash(check), rotation.Thousands(t.Writes), rotation.FormatAge(t.Age(now)), yesNo(writtenNow(t.Key, members)))
	}
	_ = tw.Flush()
}

// writtenNow reports whether a live member writes with k.
func writtenNow(k transformers.KeyInfo, members []cluster.MemberState) bool {
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Write.SameKey(k) && r.Write.KeyIDHash == k.KeyIDHash {
				return true
			}
		}
	}
	return false
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
