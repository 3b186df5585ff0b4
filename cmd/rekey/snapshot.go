package main

import (
	"fmt"
	"io"
	"os"
	"os/signal"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/internal/etcdsnapshot"
	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// snapshotReaderCommand is the hidden subcommand of inventory that reads a snapshot's
// bbolt database for rekey inventory --snapshot, which runs its own binary with it:
// bbolt follows page ids through unsafe pointers, and a fault it meets in a damaged
// file ends that child process instead of rekey (internal/etcdsnapshot/snapshotfile).
const snapshotReaderCommand = "snapshot-reader"

func newSnapshotReaderCommand() *cobra.Command {
	return &cobra.Command{
		Use:    snapshotReaderCommand + " DB",
		Short:  "Read a verified private copy of a snapshot's database for inventory --snapshot (internal)",
		Hidden: true,
		Args:   cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return snapshotfile.ServeReader(args[0], cmd.OutOrStdout())
		},
	}
}

// snapshotReport is rekey inventory --snapshot's result.
type snapshotReport struct {
	Snapshot    string                 `json:"snapshot"`
	HashSkipped bool                   `json:"hashCheckSkipped,omitempty"`
	Report      *etcdsnapshot.Report   `json:"report"`
	Config      string                 `json:"config,omitempty"`
	Missing     []etcdsnapshot.Finding `json:"unreadable,omitempty"`
	// Unverified are the buckets under a key of a name the configuration has, but of
	// which no check value is known: nothing tells whether it is the same secret.
	Unverified []etcdsnapshot.Finding `json:"noCheckValueKnown,omitempty"`
}

// snapshotInventory lists what the snapshot file at path needs, offline, and with
// --encryption-provider-config whether that configuration reads it all (an error when
// it does not, or when that cannot be told).
func (c *common) snapshotInventory(cmd *cobra.Command, path, coordinationFlag string, skipHashCheck bool, output outputFormat) error {
	var cfg *config.Config
	if c.src.given() {
		var err error
		if cfg, err = c.loadSource(cmd.Context()); err != nil {
			return err
		}
	}
	// Ctrl-C stops the reader process and removes the private copy of the snapshot
	// (its plaintext objects included) before rekey exits.
	ctx, stop := signal.NotifyContext(cmd.Context(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	rep, err := etcdsnapshot.Inventory(ctx, path, etcdsnapshot.Options{
		Layout:             storagelayout.Kube(c.etcdPrefix),
		CoordinationPrefix: c.coordinationPrefix(coordinationFlag),
		Read: snapshotfile.Options{
			SkipHashCheck: skipHashCheck,
			Reader:        snapshotfile.SelfReader("inventory", snapshotReaderCommand),
		},
	})
	if err != nil {
		return err
	}
	out := snapshotReport{Snapshot: path, HashSkipped: skipHashCheck, Report: rep}
	if cfg != nil {
		out.Config = fmt.Sprintf("%s (%s)", c.sourceName(), cfg.Hash)
		out.Missing, out.Unverified = etcdsnapshot.Check(rep, cfg)
	}
	if err := output.write(cmd.OutOrStdout(), out, func(w io.Writer) { writeSnapshotTable(w, out) }); err != nil {
		return err
	}
	if len(out.Missing) > 0 {
		return fmt.Errorf("%s cannot read %d sets of objects of snapshot %s; restoring it with this configuration loses them", c.sourceName(), len(out.Missing), path)
	}
	if len(out.Unverified) > 0 {
		return fmt.Errorf("cannot tell whether %s reads %d sets of objects of snapshot %s: no check value is known for their keys, and a key of the same name may be another secret; "+
			"to be sure, restore the snapshot into a scratch etcd and run rekey inventory --decrypt-check against it", c.sourceName(), len(out.Unverified), path)
	}
	return nil
}

// writeSnapshotTable renders a snapshot report: key names and hashes come from the
// stored data, so they go out through row and printLine only.
func writeSnapshotTable(w io.Writer, out snapshotReport) {
	rep := out.Report
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "RESOURCE", "PROVIDER", "KEY", "CHECK / KEY ID HASH", "OBJECTS")
	for _, r := range rep.Resources {
		for _, b := range r.Buckets {
			id := b.KeyIDHash
			switch {
			case id != "":
			case len(b.Checks) > 0:
				id = strings.Join(b.Checks, ",")
			case b.NoCheckValue:
				id = "no check value known"
			}
			row(tw, r.Resource, b.Provider, orDash(b.Key), orDash(id), fmt.Sprint(b.Objects))
		}
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	printLine(w, "snapshot %s at revision %d: %d resources", out.Snapshot, rep.Revision, len(rep.Resources))
	if out.HashSkipped {
		fmt.Fprintln(w, "etcd's sha256 of the snapshot was not checked (--skip-hash-check)")
	}
	if rep.Ledger == nil {
		fmt.Fprintln(w, "the snapshot holds no key ledger: no check value is known for its local keys, and a key's name does not tell its secret")
	}
	if out.Config == "" {
		return
	}
	if len(out.Missing) == 0 && len(out.Unverified) == 0 {
		printLine(w, "OK: %s can read every object of the snapshot", out.Config)
		return
	}
	if len(out.Missing) > 0 {
		printLine(w, "%s cannot read:", out.Config)
		for _, m := range out.Missing {
			printLine(w, "  - %s", m)
		}
	}
	if len(out.Unverified) > 0 {
		printLine(w, "%s has keys of these names, but no check value is known to tell whether they are the secrets the objects were written with:", out.Config)
		for _, m := range out.Unverified {
			printLine(w, "  - %s: %d objects under %s", m.Resource, m.Bucket.Objects, m.Bucket)
		}
	}
}
