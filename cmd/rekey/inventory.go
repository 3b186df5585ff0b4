package main

import (
	"errors"
	"fmt"
	"io"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

func newInventoryCommand() *cobra.Command {
	var c common
	var output outputFormat
	var decrypt, skipHashCheck bool
	var prefix, snapshot string
	cmd := &cobra.Command{
		Use:   "inventory",
		Short: "Count stored objects per resource, provider, key and state (current or stale)",
		Long: `inventory scans the etcd keys of each resource at one revision, page by page, and
counts objects per provider and key: the aes/secretbox key name, or the KMS v2 provider
name and the sha256 hash of the key id read from the stored EncryptedObject (no plugin
call). An object is stale when it was not written with the resource's current write key;
rekey migrate rewrites those. --decrypt-check also decrypts every value to find the
ones that cannot be read.

Unreadable objects are listed (the first 1000 per resource) with their namespace,
name, stored prefix and why they cannot be read: unknown-key (no key of the configuration
has the prefix), decrypt-failed (a key has it but does not decrypt the value), corrupt (a
KMS v2 envelope that does not decode) or not-a-kubernetes-object. Those acknowledged with
rekey migrate --acknowledge-unreadable are marked so.

--snapshot FILE reads an etcd snapshot file offline instead (no --etcd-servers): the
keys its objects need, per resource and stored prefix or KMS key id, with the check
values the snapshot's key ledger recorded for them ("no check value known" where it
recorded none); with --encryption-provider-config it fails unless that configuration
can read them all, by check value: a local key of the right name whose check value is
not known is not taken for the right secret. The file is verified before it is read:
etcd's trailing sha256 (--skip-hash-check skips it, for a database copied from a
member's data directory, which has none), then the bbolt pages, read from a private
copy in $TMPDIR by a child process; a damaged file fails with "corrupt snapshot".`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if snapshot != "" {
				return c.snapshotInventory(cmd, snapshot, prefix, skipHashCheck, output)
			}
			if skipHashCheck {
				return errors.New("--skip-hash-check applies to --snapshot only")
			}
			ctx := cmd.Context()
			s, err := c.open(ctx, preamble{config: true})
			if err != nil {
				return err
			}
			defer s.Close()
			c.acknowledgedUnder = c.coordinationPrefix(prefix)
			inv, _, err := c.inventory(ctx, s.etcd, s.cur, decrypt, s.cur.cfg)
			if err != nil {
				return err
			}
			return output.write(cmd.OutOrStdout(), inv, func(w io.Writer) { writeTable(w, inv) })
		},
	}
	c.addFlags(cmd.Flags())
	addOutputFlag(cmd.Flags(), &output)
	addCoordinationPrefixFlag(cmd.Flags(), &prefix)
	cmd.Flags().StringVar(&snapshot, "snapshot", "", "An etcd snapshot file (etcdctl snapshot save) to inventory offline instead of etcd.")
	cmd.Flags().BoolVar(&skipHashCheck, "skip-hash-check", false, "With --snapshot: do not check etcd's sha256 at the end of the file (as etcdutl snapshot restore --skip-hash-check); needed for a database copied from a member's data directory (member/snap/db), which has none.")
	cmd.AddCommand(newSnapshotReaderCommand())
	cmd.Flags().BoolVar(&decrypt, "decrypt-check", false, "Also decrypt every value (KMS v2: calls the plugin for each DEK not cached) to count unreadable objects exactly.")
	return cmd
}

// writeTable renders an inventory: key names, key id hashes and etcd keys come from the
// stored data, so they go out through row and printLine only.
func writeTable(w io.Writer, inv *migrate.Inventory) {
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "RESOURCE", "PROVIDER", "KEY", "KEY ID HASH", "STATE", "OBJECTS", "UNREADABLE")
	for _, r := range inv.Resources {
		for _, b := range r.Buckets {
			key := b.Key
			if key == "" && b.Provider != transformers.ProviderIdentity {
				key = "?"
			}
			if !b.KnownKey {
				key += " (not in config)"
			}
			state := "current"
			if b.Stale {
				state = "stale"
			}
			hash := b.KeyIDHash
			if hash == "" {
				hash = "-"
			}
			unreadable := "-"
			if inv.DecryptChecked {
				unreadable = fmt.Sprint(b.Unreadable)
			} else if !b.KnownKey {
				unreadable = fmt.Sprint(b.Objects)
			}
			row(tw, r.Resource, b.Provider, orDash(key), hash, state, fmt.Sprint(b.Objects), unreadable)
		}
	}
	_ = tw.Flush()
	fmt.Fprintln(w)
	for _, r := range inv.Resources {
		printLine(w, "%s: %d objects at revision %d, %d stale, %d plaintext, %d unreadable; written with %s",
			r.Resource, r.Objects, r.Revision, r.Stale, r.Plaintext, r.Unreadable, writeDesc(r))
		if r.Acknowledged > 0 {
			printLine(w, "  %d of the unreadable are acknowledged", r.Acknowledged)
		}
	}
	writeUnreadable(w, inv)
	fmt.Fprintf(w, "inventory took %s\n", inv.Duration.Round(1e6))
}

// writeUnreadable lists the unreadable objects the inventory names: etcd keys and
// prefixes come from the stored data, so they go out through row and printLine only.
func writeUnreadable(w io.Writer, inv *migrate.Inventory) {
	if inv.TotalUnreadable() == 0 {
		return
	}
	fmt.Fprintln(w)
	tw := tabwriter.NewWriter(w, 0, 4, 2, ' ', 0)
	row(tw, "RESOURCE", "NAMESPACE", "NAME", "STORED PREFIX", "CLASS", "ACKNOWLEDGED")
	for _, r := range inv.Resources {
		for _, o := range r.UnreadableObjects {
			ack := "no"
			if o.Acknowledged {
				ack = "yes"
			}
			row(tw, r.Resource, orDash(o.Namespace), o.Name, o.Prefix, o.Class, ack)
		}
	}
	_ = tw.Flush()
	for _, r := range inv.Resources {
		if more := r.Unreadable - int64(len(r.UnreadableObjects)); more > 0 {
			printLine(w, "%s: %d more unreadable objects not listed (an inventory lists the first %d)", r.Resource, more, migrate.MaxUnreadableListed)
		}
	}
	fmt.Fprintln(w, "acknowledge the ones that may stay unreadable: rekey migrate --acknowledge-unreadable <resource>/<namespace>/<name>[,...] --reason \"...\"")
}

func orDash(s string) string {
	if s == "" {
		return "-"
	}
	return s
}

func writeDesc(r migrate.ResourceInventory) string {
	if r.WritePrefix == "" {
		return "identity (plaintext)"
	}
	if r.WriteKeyIDHash != "" {
		return r.WritePrefix + " key id " + r.WriteKeyIDHash
	}
	return r.WritePrefix
}
