package main

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/pkg/keyledger"
)

// A subcommand of its own rather than a section of rekey status: status is the live
// cluster's convergence (and exits non-zero until it converges), the ledger is history
// that backups need long after every member has forgotten a key.
func newLedgerCommand() *cobra.Command {
	var c common
	var output outputFormat
	var prefix string
	cmd := &cobra.Command{
		Use:   "ledger",
		Short: "List every key the cluster wrote with, and when it retired: what etcd backups need",
		Long: fmt.Sprintf(`ledger prints the key ledger the apiservers keep in etcd under --coordination-prefix:
every local key (provider, name, check value) and KMS v2 key id (sha256 hash) any of
them wrote with, when it was first and last written, the last time an inventory counted
objects under it, and when it retired (nobody writes with it and an inventory taken
after its last write found no object under it), each with the etcd revision it was
observed at. A snapshot taken before a key's retirement may need it: keep the key (or a
copy of it, offline) as long as you keep such snapshots. rekey inventory --snapshot
FILE says which keys one snapshot needs. No key material is stored or printed.

The ledger lists at most %d key ids of one KMS v2 provider; earlier ones are one history
row of the provider ("N earlier key ids"), which holds the provider as long as the
latest of them needs it. Entries that no apiserver's --backup-retention covers any more
are forgotten beyond %d entries; should more than %d be needed, the oldest go anyway
and the ledger notes up to when it forgot, so that the guard refuses to drop a key it
does not know while a snapshot within the retention may need it.`, keyledger.MaxKMSKeyIDs, keyledger.MaxEntries, keyledger.MaxHeldEntries),
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx := cmd.Context()
			s, err := c.open(ctx, preamble{})
			if err != nil {
				return err
			}
			defer s.Close()
			l, _, _, err := keyledger.Store{Client: s.etcd, Key: keyledger.Key(c.coordinationPrefix(prefix))}.Load(ctx)
			if err != nil {
				return err
			}
			return output.write(cmd.OutOrStdout(), l, func(w io.Writer) { writeLedgerTable(w, l, time.Now()) })
		},
	}
	fs := cmd.Flags()
	c.addEtcdFlags(fs)
	c.addEtcdPrefixFlag(fs)
	addCoordinationPrefixFlag(fs, &prefix)
	addOutputFlag(fs, &output)
	return cmd
}

// writeLedgerTable renders the ledger; names come from configurations, so they go out
// through row only.
func writeLedgerTable(w io.Writer, l *keyledger.Ledger, now time.Time) {
	if len(l.Entries) == 0 {
		fmt.Fprintln(w, "the key ledger is empty: no apiserver has recorded a key yet")
		return
	}
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "PROVIDER", "NAME", "CHECK / KEY ID HASH", "FIRST WRITTEN", "LAST WRITTEN", "LAST STORED", "RETIRED")
	for _, e := range l.Entries {
		id := e.Check
		switch {
		case e.IsHistory():
			id = fmt.Sprintf("%d earlier key ids", e.EarlierKeyIDs)
		case e.KeyIDHash != "":
			id = e.KeyIDHash
		}
		row(tw, e.Provider, e.Name, orDash(id), eventText(&e.FirstUse, now), eventText(&e.LastUse, now), eventText(e.LastStored, now), eventText(e.Retired, now))
	}
	_ = tw.Flush()
	if f := l.Forgotten; f != nil {
		fmt.Fprintf(w, "\nThe ledger forgot keys retired up to %s to stay within %d entries: the backup-retention guard refuses to drop a key it does not know until that date plus the retention.\n",
			eventText(f, now), keyledger.MaxHeldEntries)
	}
}

func eventText(e *keyledger.Event, now time.Time) string {
	if e == nil {
		return "-"
	}
	return fmt.Sprintf("%s (%s ago, rev %d)", e.At.Format(time.RFC3339), now.Sub(e.At).Round(time.Minute), e.Revision)
}
