package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
)

// backupRetention is --backup-retention of the commands that remove keys, with the
// command's --coordination-prefix flag (where the key ledger and the member records
// are).
type backupRetention struct {
	retention time.Duration
	prefix    *string
	flags     *pflag.FlagSet
}

// addFlag adds --backup-retention; prefix is the command's --coordination-prefix
// value.
func (b *backupRetention) addFlag(fs *pflag.FlagSet, prefix *string) {
	b.prefix, b.flags = prefix, fs
	fs.DurationVar(&b.retention, guard.BackupRetentionFlag, 0, "How long etcd snapshots are kept (e.g. 168h): refuse to remove a key that a snapshot within it may need, per the key ledger the apiservers keep in etcd (rekey ledger lists it). The apiservers publish their own --backup-retention: the largest of theirs and this one is checked, so the file written is one they accept. 0 (the default) adds nothing to theirs. Needed when an apiserver does not publish its retention (an older rekey): give the longest any of them runs.")
}

// errRetentionUnknown: a live apiserver does not publish its --backup-retention.
var errRetentionUnknown = errors.New("the backup retention of the apiservers is unknown")

// effective is the retention the apiservers' guards apply to a file that drops keys:
// the largest of this command's flag and what the live members publish, with whose
// it is ("" when the flag's). A member that does not publish its retention (an older
// rekey) may refuse what this command allows, so it is an error unless the flag was
// given: the operator then vouches for the longest retention.
func (b *backupRetention) effective(ctx context.Context, cli *clientv3.Client, prefix string) (time.Duration, string, error) {
	snap, err := cluster.ReadSnapshot(ctx, cli, prefix)
	if err != nil {
		return 0, "", fmt.Errorf("cannot read the --%s the apiservers publish under %s: %w; retry once etcd answers", guard.BackupRetentionFlag, coordination.MembersPrefix(prefix), err)
	}
	longest, by, unknown := cluster.LargestRetention(snap.Members)
	if len(unknown) > 0 && (b.flags == nil || !b.flags.Changed(guard.BackupRetentionFlag)) {
		return 0, "", fmt.Errorf("%w: apiserver %s does not publish its --%s (an older rekey), so its guard may refuse a file that drops keys; pass --%s with the longest retention any apiserver runs (0 if none checks one)",
			errRetentionUnknown, strings.Join(unknown, ", "), guard.BackupRetentionFlag, guard.BackupRetentionFlag)
	}
	if longest <= b.retention {
		return b.retention, "", nil
	}
	who := "apiserver " + by[0]
	if len(by) > 1 {
		who = "apiservers " + strings.Join(by, ", ")
	}
	return longest, "published by " + who, nil
}

// check refuses next when it drops a key the ledger holds for the retention the
// apiservers apply (effective; guard.CheckRetentionChange); override lets it through,
// as --unsafe-allow-dropping-keys-in-use does.
func (b *backupRetention) check(ctx context.Context, c *common, cli *clientv3.Client, cur, next *config.Config, override bool) error {
	if len(guard.DroppedKeys(guard.ConfigKeys(cur), guard.ConfigKeys(next))) == 0 {
		return nil
	}
	flag := ""
	if b.prefix != nil {
		flag = *b.prefix
	}
	prefix := c.coordinationPrefix(flag)
	retention, source, err := b.effective(ctx, cli, prefix)
	if err != nil {
		return err
	}
	store := keyledger.Store{Client: cli, Key: keyledger.Key(prefix)}
	return guard.CheckRetentionChange(ctx, guard.RetentionOptions{
		Retention: retention,
		Source:    source,
		Ledger: func(ctx context.Context) (*keyledger.Ledger, error) {
			l, _, _, err := store.Load(ctx)
			return l, err
		},
		Override: func() bool { return override },
	}, cur, next)
}
