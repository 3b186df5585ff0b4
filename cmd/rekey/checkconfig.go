package main

import (
	"errors"
	"fmt"

	"github.com/spf13/cobra"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
)

func newCheckConfigCommand() *cobra.Command {
	var c common
	var next string
	var override bool
	cmd := &cobra.Command{
		Use:   "check-config",
		Short: "Refuse a new encryption configuration that would drop a key still encrypting stored data",
		Long: `check-config takes an inventory with the current configuration and checks that the
new one (--new) can still read every object of every resource either configuration
names (a wildcard rule such as *.apps is judged as a whole, without counts): it fails, naming the resource, key and
object count, when a key or provider that still encrypts stored data is missing or has a
different secret, when the current write key is dropped in one step, or when a resource
cannot be judged. Run it before you install a new configuration; the apiserver shim
applies the same guard to every reload.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := c.validate(); err != nil {
				return err
			}
			if next == "" {
				return errors.New("--new is required: the configuration you intend to install")
			}
			nextCfg, err := config.Load(next, config.Options{Reload: true})
			if err != nil {
				return err
			}
			ctx := cmd.Context()
			cli, err := c.client(ctx)
			if err != nil {
				return err
			}
			defer cli.Close()
			cur, err := c.load(ctx, c.configPath, false)
			if err != nil {
				return err
			}
			defer cur.set.Close()
			// Scan what either configuration names: a rule only the new one has still
			// changes how its resource's stored objects are read.
			res, err := c.resourceList(cur.cfg, nextCfg)
			if err != nil {
				return err
			}
			inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(cur.set), Resources: res, PageSize: c.pageSize, ConfigHash: cur.cfg.Hash})
			if err != nil {
				return err
			}
			store := &migrate.InventoryStore{}
			store.Set(inv)
			guard := migrate.NewGuard(store, func() bool { return override }, nil, klog.Background())
			if vs := migrate.CheckChange(inv, cur.cfg, nextCfg); len(vs) > 0 && override {
				fmt.Fprintf(cmd.OutOrStdout(), "WARNING: --%s is set; these objects become unreadable with %s:\n", migrate.OverrideFlag, next)
				for _, v := range vs {
					fmt.Fprintf(cmd.OutOrStdout(), "  - %s\n", v)
				}
				return nil
			}
			if err := guard(cur.cfg, nextCfg); err != nil {
				return err
			}
			fmt.Fprintf(cmd.OutOrStdout(), "OK: %s (%s) can read every stored object of %d resources\n", next, nextCfg.Hash, len(res))
			return nil
		},
	}
	c.addFlags(cmd.Flags())
	cmd.Flags().StringVar(&next, "new", "", "The configuration to check. Required.")
	cmd.Flags().BoolVar(&override, migrate.OverrideFlag, false, "Report violations but succeed anyway (disaster recovery).")
	return cmd
}
