package main

import (
	"context"
	"time"

	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
)

// backupRetention is --backup-retention of the commands that remove keys, with the
// command's --coordination-prefix flag (where the key ledger is).
type backupRetention struct {
	retention time.Duration
	prefix    *string
}

// addBackupRetentionFlag adds --backup-retention; prefix is the command's
// --coordination-prefix value.
func (b *backupRetention) addFlag(fs *pflag.FlagSet, prefix *string) {
	b.prefix = prefix
	fs.DurationVar(&b.retention, guard.BackupRetentionFlag, 0, "How long etcd snapshots are kept (e.g. 168h): refuse to remove a key that a snapshot within it may need, per the key ledger the apiservers keep in etcd (rekey ledger lists it). 0 (the default) checks nothing, for clusters without etcd backups.")
}

// check refuses next when it drops a key the ledger holds for the retention
// (guard.CheckRetentionChange); override lets it through, as --unsafe-allow-dropping-keys-in-use does.
func (b *backupRetention) check(ctx context.Context, c *common, cli *clientv3.Client, cur, next *config.Config, override bool) error {
	prefix := ""
	if b.prefix != nil {
		prefix = *b.prefix
	}
	store := keyledger.Store{Client: cli, Key: keyledger.Key(c.coordinationPrefix(prefix))}
	return guard.CheckRetentionChange(ctx, guard.RetentionOptions{
		Retention: b.retention,
		Ledger: func(ctx context.Context) (*keyledger.Ledger, error) {
			l, _, _, err := store.Load(ctx)
			return l, err
		},
		Override: func() bool { return override },
	}, cur, next)
}
