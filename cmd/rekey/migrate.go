package main

import (
	"errors"
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/term"

	"github.com/rekey-io/rekey/pkg/migrate"
)

func newMigrateCommand() *cobra.Command {
	var c common
	var o migrate.Options
	var progress string
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
--resume.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if err := c.validate(); err != nil {
				return err
			}
			if o.Resume && o.CheckpointPath == "" {
				return errors.New("--resume needs --checkpoint: the file the stopped run wrote")
			}
			ctx := cmd.Context()
			cli, err := c.client(ctx)
			if err != nil {
				return err
			}
			defer cli.Close()
			l, err := c.load(ctx, c.configPath, true)
			if err != nil {
				return err
			}
			defer l.set.Close()
			if o.Resources, err = c.resourceList(l.cfg); err != nil {
				return err
			}
			o.Client, o.Source, o.PageSize, o.ConfigHash = cli, migrate.FromSet(l.set), c.pageSize, l.cfg.Hash
			p := newProgressPrinter(cmd.ErrOrStderr(), progress)
			o.Progress = p.update
			res, err := migrate.Migrate(ctx, o)
			p.finish()
			if res != nil {
				fmt.Fprintf(cmd.OutOrStdout(), "scanned %d, rewritten %d, already current %d, conflicts %d, deleted meanwhile %d, unreadable %d in %s (%d passes)\n",
					res.Scanned, res.Rewritten, res.Current, res.Conflicts, res.Gone, res.Unreadable, res.Duration.Round(time.Millisecond), res.Passes)
				if res.Verified != nil && err == nil {
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
	fs.Float64Var(&o.Rate, "rate", 0, "Rewrite at most this many objects per second (0: no limit).")
	fs.StringVar(&o.CheckpointPath, "checkpoint", "", "Record progress in this file so a stopped migration can be resumed.")
	fs.BoolVar(&o.Resume, "resume", false, "Continue the migration recorded in --checkpoint.")
	fs.IntVar(&o.BatchSize, "batch-size", migrate.DefaultBatchSize, "Rewrites per etcd transaction (etcd allows 128 operations by default).")
	fs.IntVar(&o.Workers, "workers", 0, "Parallel re-encryption workers (default 2 × CPUs).")
	fs.IntVar(&o.MaxPasses, "max-passes", migrate.DefaultMaxPasses, "Migrate-and-verify rounds before giving up on objects that keep turning stale.")
	fs.StringVar(&progress, "progress", "auto", "Progress display: auto (a bar on a terminal, periodic lines otherwise), bar, lines or none.")
	return cmd
}

// progressPrinter draws a progress bar on a terminal, or a line every few seconds.
type progressPrinter struct {
	w       io.Writer
	mode    string
	mu      sync.Mutex
	last    time.Time
	drawn   bool
	lastLen int
}

func newProgressPrinter(w io.Writer, mode string) *progressPrinter {
	if mode == "auto" {
		mode = "lines"
		if f, ok := w.(*os.File); ok && term.IsTerminal(int(f.Fd())) {
			mode = "bar"
		}
	}
	return &progressPrinter{w: w, mode: mode}
}

func (p *progressPrinter) update(pr migrate.Progress) {
	p.mu.Lock()
	defer p.mu.Unlock()
	now := time.Now()
	switch p.mode {
	case "bar":
		if now.Sub(p.last) < 100*time.Millisecond && pr.Done != pr.Total && pr.Phase == "migrate" {
			return
		}
		p.last = now
		line := renderBar(pr, 30)
		pad := ""
		if n := p.lastLen - len(line); n > 0 {
			pad = strings.Repeat(" ", n)
		}
		fmt.Fprintf(p.w, "\r%s%s", line, pad)
		p.lastLen, p.drawn = len(line), true
	case "lines":
		if now.Sub(p.last) < 5*time.Second && pr.Phase == "migrate" && pr.Done != 0 {
			return
		}
		p.last = now
		fmt.Fprintln(p.w, renderBar(pr, 0))
	}
}

func (p *progressPrinter) finish() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.drawn {
		fmt.Fprintln(p.w)
	}
}

// renderBar renders one progress line; width 0 leaves the bar out.
func renderBar(pr migrate.Progress, width int) string {
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
		n := int(frac * float64(width))
		bar = "[" + strings.Repeat("=", n) + strings.Repeat(" ", width-n) + "] "
	}
	return fmt.Sprintf("pass %d %-12s %s%6d/%-6d %3.0f%%  %5.0f obj/s  rewritten %d  conflicts %d  unreadable %d",
		pr.Pass, pr.Resource, bar, pr.Done, pr.Total, frac*100, rate, pr.Rewritten, pr.Conflicts, pr.Unreadable)
}
