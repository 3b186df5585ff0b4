package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/transformers"
)

func newRotateCommand() *cobra.Command {
	var c common
	var r rotation.Request
	var output string
	var removeOld string
	var w waitOptions
	var cond rotateCondition
	cmd := &cobra.Command{
		Use:   "rotate",
		Short: "Put a new write key first in the encryption configuration, or remove the key it replaced",
		Long: `rotate generates a new random 32-byte key and writes it first in every rule whose
write provider is a local key (aesgcm, aescbc, secretbox); the key it replaces stays right
behind it, so every apiserver can still read what it wrote. identity behind a write key
(the fallback for values written before encryption) stays there. --provider changes the type:
aesgcm, secretbox, aescbc (deprecated upstream; a warning is printed) or kms, which adds a
KMS v2 provider (--kms-name, --kms-endpoint unix:///…) first; before the file is written,
every KMS v2 plugin of the new configuration must answer a healthy Status with a key id
and encrypt and decrypt a random test value within its timeout (--skip-preflight skips
that, with a warning, for preparing a file where the plugin is not reachable). When no rule writes with a
local key or KMS v2, --provider aesgcm (or secretbox, or kms) encrypts the rules that
write identity (first-time encryption). A KMS v2 name may appear once per file, so --provider kms rotates exactly one
rule (--resources picks it). --resources keeps only the rules naming one of the given
resources as written in the file; it picks rules, never part of one: the inventories
rotate takes for its decisions and for the guard always cover every resource of the
rules it changes, and --resources only adds to them.

The file is replaced atomically (temporary file in the same directory, fsync, rename)
with its mode and owner kept, and only after pkg/config validated the result; comments
are not kept. -o - prints the new configuration instead (GitOps, a configuration held
in a Secret).

Once every apiserver writes with the new key and the migration is verified (rekey
status, rekey migrate), --remove-old NAME removes the read key NAME (step 1 prints it). It takes a
fresh inventory (--etcd-servers) and refuses, naming resource, key and object count,
when any stored object still needs that key, or when an etcd snapshot within the
largest --backup-retention (this flag, or one a live apiserver publishes) may need it,
per the key ledger (rekey ledger).

--wait runs the whole rotation and follows the apiservers (cluster coordination, under
--coordination-prefix): new key first in the file; every apiserver writes with it; the
migration leader verified every stored object; the old key removed behind the same guard;
every apiserver runs the final file. It exits 0 only then, and non-zero after
--wait-timeout, naming the stage and what it waits for. Run again after an
interruption, it finds the rotation in progress from what is stored (an inventory, the
migration leader's records) and the file, and continues it (no second new key): a
rule with an old key behind its write key, objects stored under a key behind it
(plaintext under identity, an older KMS key id), or a migration running. identity
behind the write key stays unless --remove-identity-fallback. It refuses, before any
edit, a rotation whose resources no live apiserver migrates (--storage-migration,
--storage-migration-resources), and fails a wait during which none does any more.

--if-writes-over N and --if-older-than D make the rotation conditional (a scheduled
job): it happens only when a write key of the rules it would rotate sealed more than N
values over the cluster's lifetime, or was first configured longer than D ago (either,
when both are given), as the apiservers' per-key totals in etcd say. rotate prints why
it did or did not rotate and exits 0 in both cases. See docs/rotation.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if !c.src.given() {
				return errors.New("--encryption-provider-config (a file) or --secret (a Secret's key) is required: rotate edits the configuration kept there")
			}
			f, err := c.readSource(cmd.Context(), "the current configuration is not valid, so rotate leaves it alone")
			if err != nil {
				return err
			}
			r.Resources = c.resources
			if cond.active() && removeOld != "" {
				return errors.New("--if-writes-over and --if-older-than decide whether to add a new write key; --remove-old is not conditional (its guard decides)")
			}
			if cond.active() {
				due, why, err := c.rotationDue(cmd.Context(), f.File, cond, w.prefix)
				if err != nil {
					return err
				}
				fmt.Fprintln(cmd.OutOrStdout(), why)
				if !due {
					return nil
				}
			}
			if w.removeIdentity && !w.wait {
				return errors.New("--remove-identity-fallback goes with --wait; step by step, remove identity with --remove-old identity")
			}
			if w.wait {
				if output != "" || removeOld != "" {
					return errors.New("--wait runs the whole rotation (both edits) on the file; it does not combine with -o or --remove-old")
				}
				r.Random = rand.Reader
				return c.rotateWait(cmd, r, w)
			}
			return c.rotateStep(cmd, f, r, removeOld, output)
		},
	}
	c.addFlags(cmd.Flags())
	c.addPreflightFlag(cmd.Flags())
	fs := cmd.Flags()
	fs.StringVar(&r.Provider, "provider", "", "Type of the new write key: aesgcm, secretbox, aescbc (deprecated) or kms. Default: the type each rule writes with now.")
	fs.StringVar(&r.KMSName, "kms-name", "", "Name of the new KMS v2 provider (--provider kms).")
	fs.StringVar(&r.KMSEndpoint, "kms-endpoint", "", "Socket of the new KMS v2 plugin, unix:///path (--provider kms).")
	fs.DurationVar(&r.KMSTimeout, "kms-timeout", 0, "Timeout of the new KMS v2 provider (--provider kms); default: the apiserver's (3s).")
	fs.StringVarP(&output, "output", "o", "", "- prints the new configuration to stdout and leaves the file alone.")
	w.addFlags(fs)
	cond.addFlags(fs)
	c.retention.addFlag(fs, &w.prefix)
	fs.StringVar(&removeOld, "remove-old", "", "Remove this read key (a local key name, a KMS provider name, or identity) from every rule that writes with another key (narrowed by --resources), after the guard allows it. Needs --etcd-servers.")
	return cmd
}

// rotateStep makes one edit of f, the first (a new write key) or with removeOld the
// second, and replaces the file with it, or prints it with -o -.
func (c *common) rotateStep(cmd *cobra.Command, f sourced, r rotation.Request, removeOld, output string) error {
	var e *rotation.Edit
	var err error
	var summary string
	if removeOld != "" {
		if e, err = c.removeKeys(cmd.Context(), f.File, []string{removeOld}, r.Resources); err != nil {
			return err
		}
		summary = e.Summary
	} else {
		r.Now, r.Random = time.Now(), rand.Reader
		if e, err = c.addKey(cmd.Context(), cmd.ErrOrStderr(), f.File, r); err != nil {
			return err
		}
		summary = fmt.Sprintf("%s until `rekey rotate --remove-old NAME` (NAME: %s)", e.Summary, strings.Join(e.OldKeys, ", "))
	}
	if output == "-" {
		_, err := cmd.OutOrStdout().Write(e.Data)
		fmt.Fprintln(cmd.ErrOrStderr(), summary)
		return err
	}
	if output != "" {
		return fmt.Errorf("-o %q: only - (print the new configuration) is supported; without -o the file is replaced", output)
	}
	// The edit (and for a removal the guard's inventory of etcd) was worked out on the
	// version read; it replaces exactly that version, or nothing: two edits never
	// stack on one another unseen.
	if err := c.replaceSource(cmd.Context(), f, e); errors.Is(err, configsource.ErrChanged) {
		return fmt.Errorf("%w (another rotate, a person, a pipeline or a controller wrote it), so nothing was written; look at it and run rotate again if it still needs this edit", err)
	} else if err != nil {
		return fmt.Errorf("%w; the configuration is left as it was (or print the new configuration with -o - and install it yourself)", err)
	}
	fmt.Fprintf(cmd.OutOrStdout(), "%s: %s (%s)\n", c.sourceName(), summary, e.Config.Hash)
	return nil
}

// addKey is the first edit of f: a new write key first; warnings go to stderr. With
// --provider kms every KMS v2 plugin of the result is called first (preflight).
func (c *common) addKey(ctx context.Context, stderr io.Writer, f *rotation.File, r rotation.Request) (*rotation.Edit, error) {
	e, err := rotation.Add(f, r)
	if err != nil {
		return nil, err
	}
	for _, w := range e.Warnings {
		fmt.Fprintln(stderr, w)
	}
	if r.Provider == transformers.ProviderKMSv2 {
		if err := c.preflight(ctx, stderr, e.Config, "the new configuration"); err != nil {
			return nil, fmt.Errorf("%w; nothing was written", err)
		}
	}
	return e, nil
}

// removeKeys is the second edit of f: without the read keys names, once the guard
// allowed it.
func (c *common) removeKeys(ctx context.Context, f *rotation.File, names, resources []string) (*rotation.Edit, error) {
	e, err := rotation.Remove(f, names, resources)
	if err != nil {
		return nil, err
	}
	var changed []string
	for _, rule := range f.RuleResources(e.Rules) {
		changed = append(changed, rule...) // wildcards too: resolved against what is stored
	}
	if err := c.guardRemoval(ctx, f.Config, e.Config, changed); err != nil {
		return nil, err
	}
	return e, nil
}

// guardRemoval takes a fresh inventory with cur of every resource stored under the
// rules the edit changes (changed) and of --resources, and refuses next when it would
// leave a stored object unreadable (guard.CheckChange, the reload guard's rule).
// --resources picks rules; it never narrows this scan to part of a rule.
func (c *common) guardRemoval(ctx context.Context, cur, next *config.Config, changed []string) error {
	if len(c.etcd.Servers) == 0 {
		return errors.New("--remove-old needs --etcd-servers: the guard counts the objects that still use the old key before it goes")
	}
	// The transformers of cur itself: the content the caller read and decided on, not
	// the file read a second time.
	s, err := c.open(ctx, preamble{cfg: cur})
	if err != nil {
		return err
	}
	defer s.Close()
	res, err := c.withResources(ctx, s.etcd, changed)
	if err != nil {
		return err
	}
	inv, err := c.inventoryOf(ctx, s.etcd, s.cur, false, res)
	if err != nil {
		return err
	}
	if vs := guard.CheckChange(inv, cur, next); len(vs) > 0 {
		var b strings.Builder
		for _, v := range vs {
			fmt.Fprintf(&b, "\n  - %s", v)
		}
		return fmt.Errorf("the old key still encrypts stored data; run `rekey migrate` (or wait for the cluster's migrator) and try again:%s", b.String())
	}
	return c.retention.check(ctx, c, s.etcd, cur, next, false)
}
