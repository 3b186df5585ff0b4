package main

import (
	"context"
	"errors"
	"fmt"

	"github.com/spf13/cobra"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

func newCheckConfigCommand() *cobra.Command {
	var c common
	var next string
	var override, fips bool
	var prefix string
	cmd := &cobra.Command{
		Use:   "check-config",
		Short: "Refuse a new encryption configuration that would drop a key still encrypting stored data",
		Long: `check-config takes an inventory with the current configuration and checks that the
new one (--new) can still read every object of every resource either configuration
names (a wildcard rule such as *.apps is judged as a whole, without counts): it fails, naming the resource, key and
object count, when a key or provider that still encrypts stored data is missing or has a
different secret, when the current write key is dropped in one step, or when a resource
cannot be judged. When the new configuration has KMS v2 providers, it is built and one
stored object per KMS key id is decrypted with it: a provider that keeps its name but
reaches another plugin or keyring fails the check. Before anything else, every KMS v2
plugin the new configuration names must answer a healthy Status with a key id and
encrypt and decrypt a random test value within its timeout (--skip-preflight skips
that, with a warning). Run it before you install a new configuration; the apiserver shim
applies the same guard to every reload. It also refuses to drop a key that an etcd
snapshot within the largest --backup-retention (this flag, or one a live apiserver
publishes) may need, per the apiservers' key ledger, as their own guard would. With
--fips, or when rekey itself runs in FIPS 140-3 mode (GODEBUG=fips140=on or only), a
new configuration naming secretbox or a KMS v1 provider is refused first, as the
apiservers in FIPS mode refuse it at start-up and on reload (docs/fips.md).`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if next == "" {
				return errors.New("--new is required: the configuration you intend to install")
			}
			nextCfg, err := config.Load(next, config.Options{Reload: true})
			if err != nil {
				return err
			}
			mode := processFIPSMode()
			if fips && mode == transformers.FIPSOff {
				mode = transformers.FIPSOn
			}
			if err := transformers.FIPSRefusal(nextCfg, mode); err != nil {
				return fmt.Errorf("%s is refused: %w", next, err)
			}
			ctx := cmd.Context()
			if err := c.preflight(ctx, cmd.ErrOrStderr(), nextCfg, next); err != nil {
				return err
			}
			s, err := c.open(ctx, preamble{config: true})
			if err != nil {
				return err
			}
			defer s.Close()
			cur, cli := s.cur, s.etcd
			// Scan what either configuration names: a rule only the new one has still
			// changes how its resource's stored objects are read.
			inv, res, err := c.inventory(ctx, cli, cur, false, cur.cfg, nextCfg)
			if err != nil {
				return err
			}
			store := &migrate.InventoryStore{}
			store.Set(inv)
			keysInUse := guard.New(store, func() bool { return override }, nil, nil, s.log)
			if vs := guard.CheckChange(inv, cur.cfg, nextCfg); len(vs) > 0 && override {
				fmt.Fprintf(cmd.OutOrStdout(), "WARNING: --%s is set; these objects become unreadable with %s:\n", guard.OverrideFlag, next)
				for _, v := range vs {
					printLine(cmd.OutOrStdout(), "  - %s", v)
				}
				return nil
			}
			if err := keysInUse(cur.cfg, nextCfg); err != nil {
				return err
			}
			if err := c.retention.check(ctx, &c, cli, cur.cfg, nextCfg, override); err != nil {
				return err
			}
			if err := c.checkKMSDecrypt(ctx, cmd, cli, inv, next, nextCfg, override); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "OK: %s (%s) can read every stored object of %d resources\n", next, nextCfg.Hash, len(res))
			return nil
		},
	}
	c.addFlags(cmd.Flags())
	c.addPreflightFlag(cmd.Flags())
	cmd.Flags().StringVar(&next, "new", "", "The configuration to check. Required.")
	cmd.Flags().BoolVar(&fips, "fips", false, "Judge --new as apiservers in FIPS 140-3 mode do: refuse providers outside the approved set (secretbox, KMS v1). On whenever this rekey runs in FIPS mode.")
	cmd.Flags().BoolVar(&override, guard.OverrideFlag, false, "Report violations but succeed anyway (disaster recovery).")
	addCoordinationPrefixFlag(cmd.Flags(), &prefix)
	c.retention.addFlag(cmd.Flags(), &prefix)
	return cmd
}

// checkKMSDecrypt builds next when it has KMS v2 providers and decrypts one stored object
// per KMS key id of inv with it (guard.CheckDecrypt). A plugin that does not answer
// fails the check too: nothing is proven then.
func (c *common) checkKMSDecrypt(ctx context.Context, cmd *cobra.Command, cli *clientv3.Client, inv *migrate.Inventory, next string, nextCfg *config.Config, override bool) error {
	if !hasKMSv2(nextCfg) {
		return nil
	}
	l, err := c.load(ctx, next, false)
	if err != nil {
		return err
	}
	defer l.set.Close()
	fs, err := guard.CheckDecrypt(ctx, inv, cli, nextCfg, setTransformers{l.set})
	if err != nil || len(fs) == 0 {
		return err
	}
	derr := &guard.RefusedError{Check: guard.Decrypt, Next: guard.ConfigName(nextCfg), Failures: fs}
	if !override {
		return derr
	}
	printLine(cmd.OutOrStdout(), "WARNING: --%s is set; %s", guard.OverrideFlag, derr)
	return nil
}

func hasKMSv2(cfg *config.Config) bool { return len(kmsv2.KMSv2Providers(cfg)) > 0 }

// setTransformers serves a built Set as value.ResourceTransformers.
type setTransformers struct{ s *transformers.Set }

func (t setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return t.s.TransformerFor(gr)
}
