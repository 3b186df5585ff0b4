package main

import (
	"errors"
	"fmt"
	"io"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/pkg/cluster"
)

// errNotConverged makes `rekey status` exit non-zero after printing its verdict.
var errNotConverged = errors.New("the apiservers have not converged")

func newStatusCommand() *cobra.Command {
	var c common
	var output outputFormat
	var prefix string
	var alarm time.Duration
	cmd := &cobra.Command{
		Use:   "status",
		Short: "Show every apiserver's encryption keys and whether the cluster has converged",
		Long: `status reads what every live apiserver publishes under --coordination-prefix in etcd
(shims and agents running with --cluster-coordination) and prints one line per
apiserver: id, configuration hash, the key each resource is written with (and a new key
its write fence holds back), the keys it can read, KMS health, its last refused reload
and the age of its state. Records that are not live apiservers of this cluster (no
lease, another cluster's id, not parseable) are listed apart with the reason: they hold
every promotion until they are gone. The verdict follows: converged; promoting a key, waiting for
the apiservers that cannot read it yet; members disagree; migrating a resource x/y; all
prefixed by "alarm:" when members have disagreed for longer than --disagreement-alarm.
The exit code is 0 only when the cluster has converged.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			s, err := c.open(ctx, preamble{})
			if err != nil {
				return err
			}
			defer s.Close()
			snap, err := cluster.ReadSnapshot(ctx, s.etcd, c.coordinationPrefix(prefix))
			if err != nil {
				return err
			}
			totals, err := cluster.ReadKeyTotals(ctx, s.etcd, c.coordinationPrefix(prefix))
			if err != nil {
				return err
			}
			now := time.Now()
			v := cluster.Evaluate(snap.Members, snap.Migration, now, alarm)
			doc := struct {
				*cluster.Snapshot
				KeyWrites []cluster.KeyTotal `json:"keyWrites"`
				Verdict   cluster.Verdict    `json:"verdict"`
			}{snap, totals, v}
			if err := output.write(cmd.OutOrStdout(), doc, func(w io.Writer) {
				writeStatusTable(w, snap, v, now)
				writeKeyWritesTable(w, totals, snap.Members, now)
			}); err != nil {
				return err
			}
			if !v.Converged {
				return fmt.Errorf("%w: %s", errNotConverged, v.Summary)
			}
			return nil
		},
	}
	fs := cmd.Flags()
	c.addEtcdFlags(fs)
	c.addEtcdPrefixFlag(fs)
	addCoordinationPrefixFlag(fs, &prefix)
	fs.DurationVar(&alarm, "disagreement-alarm", cluster.DefaultDisagreementAlarm, "Report an alarm when a member has seen the others disagree for longer than this.")
	addOutputFlag(fs, &output)
	return cmd
}

// writeStatusTable renders what the members published: every value is text read from
// etcd, so it goes out through row and printLine only.
func writeStatusTable(w io.Writer, snap *cluster.Snapshot, v cluster.Verdict, now time.Time) {
	tw := tabwriter.NewWriter(w, 2, 4, 2, ' ', 0)
	row(tw, "APISERVER", "CONFIG", "FIPS", "WRITES", "READS", "KMS", "LAST ERROR", "AGE")
	for _, m := range snap.Members {
		var writes, reads, kms []string
		for _, r := range m.Resources {
			w := r.Resource + "=" + r.Write.String()
			if r.Held != nil {
				w += " (holding " + r.Held.String() + ")"
			}
			writes = append(writes, w)
			var rk []string
			for _, k := range r.Read {
				rk = append(rk, k.String())
			}
			reads = append(reads, r.Resource+"="+strings.Join(rk, ","))
		}
		for _, k := range m.KMS {
			h := "healthy"
			if !k.Healthy {
				h = "unhealthy"
			}
			kms = append(kms, k.Name+" "+h)
		}
		lastErr := m.LastReloadError
		if i := strings.IndexByte(lastErr, '\n'); i >= 0 {
			lastErr = lastErr[:i] + " …"
		}
		fips := "-"
		if m.FIPS != nil {
			fips = onOff(*m.FIPS)
		}
		row(tw, m.APIServerID, shortHash(m.ConfigHash), fips, strings.Join(writes, "; "), strings.Join(reads, "; "),
			dash(strings.Join(kms, ", ")), dash(lastErr), now.Sub(m.PublishedAt).Round(time.Second).String())
	}
	_ = tw.Flush()
	if mig := snap.Migration; mig != nil {
		fmt.Fprintln(w)
		printLine(w, "MIGRATION LEADER %s", dash(mig.Leader))
		for _, p := range mig.Plans {
			line := fmt.Sprintf("  %s: %s %s", p.Resource, p.State, p.Target)
			if p.Detail != "" {
				line += " (" + p.Detail + ")"
			}
			if rec, ok := mig.Records[p.Resource]; ok && rec.Verified && rec.Acknowledged > 0 {
				line += fmt.Sprintf(" [verified except %d acknowledged unreadable]", rec.Acknowledged)
			}
			printLine(w, "%s", line)
		}
	}
	if len(snap.UnknownMembers) > 0 {
		fmt.Fprintln(w)
		printLine(w, "UNKNOWN MEMBERS (not live apiservers of this cluster: they hold every promotion, and count for nobody's readiness)")
		for _, u := range snap.UnknownMembers {
			printLine(w, "  %s: %s", u.Key, u.Reason)
		}
	}
	fmt.Fprintln(w)
	printLine(w, "VERDICT %s", v.Summary)
}

func shortHash(h string) string {
	if len(h) > len("sha256:")+12 {
		return h[:len("sha256:")+12]
	}
	return dash(h)
}

func dash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}
