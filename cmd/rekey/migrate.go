package main

import (
	"errors"
	"fmt"
	"time"

	"github.com/spf13/cobra"

	"github.com/rekey-io/rekey/internal/progress"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

func newMigrateCommand() *cobra.Command {
	var c common
	var o migrate.Options
	var ack acknowledgeFlags
	mode := progress.NewFlag(progress.Auto, progress.Bar, progress.Plain, progress.None)
	cmd := &cobra.Command{
		Use:   "migrate",
		Short: "Re-encrypt every stale object with the current write key, then verify",
		Long: `migrate rewrites every stale object (not written with its resource's current write
key) through the configuration in --encryption-provider-config, directly in etcd, with a
compare-and-swap on each object's ModRevision: a concurrent update always wins and the
object is then re-read, and rewritten only if it is still stale. The plaintext is not
changed; watchers see a MODIFIED event with a new resourceVersion, as after kubectl
replace. It finishes only when a verifying re-scan (with a decrypt check) finds no stale
and no unreadable object.

Every apiserver must already run a configuration that can read the new write key before
you start (see docs/migration.md). With --checkpoint, a stopped run can be continued with
--resume.

An object no key can read any more (rekey inventory lists them) keeps the migration
unverified, and with it every later removal of a key. If it may stay unreadable,
acknowledge it with --acknowledge-unreadable <resource>/<namespace>/<name> --reason "...":
the acknowledgement is recorded in etcd under --coordination-prefix, for the value stored
now (a rewrite of the object voids it), and the migration then verifies except it.
--list-acknowledged shows them, --remove-acknowledgement takes one back.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if o.Resume && o.CheckpointPath == "" {
				return errors.New("--resume needs --checkpoint: the file the stopped run wrote")
			}
			if errs := layer.ValidateStorageMigrationSpace(o.Space.QuotaBytes, o.Space.MaxFraction); len(errs) > 0 {
				return errors.Join(errs...)
			}
			ctx := cmd.Context()
			if ack.active() {
				return ack.run(ctx, cmd.OutOrStdout(), &c)
			}
			o.CoordinationPrefix = c.coordinationPrefix(ack.prefix)
			s, err := c.open(ctx, preamble{config: true, requireKMS: true})
			if err != nil {
				return err
			}
			defer s.Close()
			covered, err := c.resolve(ctx, s.etcd, s.cur.cfg)
			if err != nil {
				return err
			}
			o.Resources = covered.Resources
			o.Client, o.Source, o.PageSize, o.ConfigHash = s.etcd, migrate.FromSet(s.cur.set), c.pageSize, s.cur.cfg.Hash
			p := progress.New(cmd.ErrOrStderr(), mode.Mode())
			o.Progress = func(pr migrate.Progress) { showMigration(p, pr) }
			res, err := migrate.Migrate(ctx, o)
			p.Done()
			if res != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "scanned %d, rewritten %d, already current %d, conflicts %d, deleted meanwhile %d, unreadable %d in %s (%d passes)\n",
					res.Scanned, res.Rewritten, res.Current, res.Conflicts, res.Gone, res.Unreadable, res.Duration.Round(time.Millisecond), res.Passes)
				switch {
				case res.Verified != nil && err == nil && res.Acknowledged > 0:
					fmt.Fprintf(cmd.OutOrStdout(), "verified except %d acknowledged: a re-scan with decryption found no stale object and no unreadable one that is not acknowledged\n", res.Acknowledged)
				case res.Verified != nil && err == nil:
					fmt.Fprintln(cmd.OutOrStdout(), "verified: a re-scan with decryption found no stale and no unreadable object")
				}
			}
			if err != nil && o.CheckpointPath != "" && !errors.Is(err, migrate.ErrNotFinished) {
				return fmt.Errorf("%w (progress is saved in %s; run again with --resume to continue)", err, o.CheckpointPath)
			}
			return err
		},
	}
	c.addFlags(cmd.Flags())
	fs := cmd.Flags()
	fs.Float64Var(&o.Rate, "rate", 0, "Rewrite at most this many objects per second (0: no ceiling); below it the rate adapts to etcd's latency.")
	o.Space = pace.SpaceOptions{QuotaBytes: pace.DefaultEtcdQuotaBytes, MaxFraction: pace.DefaultMaxDBFraction}
	layer.AddStorageMigrationSpaceFlags(fs, &o.Space.QuotaBytes, &o.Space.MaxFraction)
	fs.StringVar(&o.CheckpointPath, "checkpoint", "", "Record progress in this file so a stopped migration can be resumed.")
	fs.BoolVar(&o.Resume, "resume", false, "Continue the migration recorded in --checkpoint.")
	fs.IntVar(&o.BatchSize, "batch-size", migrate.DefaultBatchSize, "Rewrites per etcd transaction (etcd allows 128 operations by default).")
	fs.IntVar(&o.Workers, "workers", 0, "Parallel re-encryption workers (default 2 × CPUs).")
	fs.IntVar(&o.MaxPasses, "max-passes", migrate.DefaultMaxPasses, "Migrate-and-verify rounds before giving up on objects that keep turning stale.")
	ack.addFlags(fs)
	fs.Var(mode, "progress", "Progress display: auto (a bar on a terminal, periodic lines otherwise), bar, plain (periodic lines; also spelled lines) or none.")
	return cmd
}

// migrationLineEvery is how often a plain progress line is printed while a resource is
// being migrated; a new resource, a verify pass and the first page always print one.
const migrationLineEvery = 5 * time.Second

// showMigration shows one progress report: the bar's status line on a terminal, a line
// every few seconds otherwise.
func showMigration(p *progress.Writer, pr migrate.Progress) {
	switch p.Mode() {
	case progress.Bar:
		p.Status(renderBar(pr, 30), pr.Done == pr.Total || pr.Phase != "migrate")
	case progress.Plain:
		if p.SinceLine() >= migrationLineEvery || pr.Phase != "migrate" || pr.Done == 0 || pr.Paused.Reason != "" {
			p.Line(renderBar(pr, 0))
		}
	}
}

// renderBar renders one progress line; width 0 leaves the bar out.
func renderBar(pr migrate.Progress, width int) string {
	if pr.Paused.Reason != "" {
		return fmt.Sprintf("pass %d %-12s paused: %s", pr.Pass, pr.Resource, pr.Paused.Condition)
	}
	if pr.Phase == "verify" {
		return fmt.Sprintf("pass %d: verifying (re-scan with decryption)…  rewritten %d", pr.Pass, pr.Rewritten)
	}
	frac := 1.0
	if pr.Total > 0 {
		frac = min(float64(pr.Done)/float64(pr.Total), 1)
	}
	rate := 0.0
	if s := pr.Elapsed.Seconds(); s > 0 {
		rate = float64(pr.Scanned) / s
	}
	bar := ""
	if width > 0 {
		bar = progress.Fill(frac, width) + " "
	}
	return fmt.Sprintf("pass %d %-12s %s%6d/%-6d %3.0f%%  %5.0f obj/s  rewritten %d  conflicts %d  unreadable %d",
		pr.Pass, pr.Resource, bar, pr.Done, pr.Total, frac*100, rate, pr.Rewritten, pr.Conflicts, pr.Unreadable)
}
