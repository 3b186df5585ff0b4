package main

import (
	"fmt"
	"io"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/internal/etcdsnapshot"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// snapshotReport is rekey inventory --snapshot's result.
type snapshotReport struct {
	Snapshot string                    `json:"snapshot"`
	Report   *etcdsnapshot.Report      `json:"report"`
	Config   string                    `json:"config,omitempty"`
	Missing  []etcdsnapshot.Unreadable `json:"unreadable,omitempty"`
}

// snapshotInventory lists what the snapshot file at path needs, offline, and with
// --encryption-provider-config whether that configuration reads it all (an error when
// it does not).
func (c *common) snapshotInventory(cmd *cobra.Command, path, coordinationFlag string, output outputFormat) error {
	rep, err := etcdsnapshot.Inventory(path, etcdsnapshot.Options{
		Layout:             storagelayout.Kube(c.etcdPrefix),
		CoordinationPrefix: c.coordinationPrefix(coordinationFlag),
	})
	if err != nil {
		return err
	}
	out := snapshotReport{Snapshot: path, Report: rep}
	if c.configPath != "" {
		cfg, err := config.Load(c.configPath, config.Options{Reload: true})
		if err != nil {
			return err
		}
		out.Config = fmt.Sprintf("%s (%s)", c.configPath, cfg.Hash)
		out.Missing = etcdsnapshot.Check(rep, cfg)
	}
	if err := output.write(cmd.OutOrStdout(), out, func(w io.Writer) { writeSnapshotTable(w, out) }); err != nil {
		return err
	}
	if len(out.Missing) > 0 {
		return fmt.Errorf("%s cannot read %d sets of objects of snapshot %s; restoring it with this configuration loses them", c.configPath, len(out.Missing), path)
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
			if id == "" {
				id = strings.Join(b.Checks, ",")
			}
			row(tw, r.Resource, b.Provider, orDash(b.Key), orDash(id), fmt.Sprint(b.Objects))
		}
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	printLine(w, "snapshot %s at revision %d: %d resources", out.Snapshot, rep.Revision, len(rep.Resources))
	if rep.Ledger == nil {
		fmt.Fprintln(w, "the snapshot holds no key ledger: local keys are matched by name only, not by check value")
	}
	if out.Config == "" {
		return
	}
	if len(out.Missing) == 0 {
		printLine(w, "OK: %s can read every object of the snapshot", out.Config)
		return
	}
	printLine(w, "%s cannot read:", out.Config)
	for _, m := range out.Missing {
		printLine(w, "  - %s", m)
	}
}
