package main

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/internal/progress"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// waitOptions are rotate's --wait flags.
type waitOptions struct {
	wait     bool
	prefix   string
	timeout  time.Duration
	progress *progress.Flag
	// removeIdentity removes identity from behind the new write key too.
	removeIdentity bool
	// interval is how often the file and etcd are read.
	interval time.Duration
}

func (w *waitOptions) addFlags(fs *pflag.FlagSet) {
	w.progress = progress.NewFlag(progress.Auto, progress.Bar, progress.Plain)
	fs.BoolVar(&w.wait, "wait", false, "Run the whole rotation: write the new key first, follow the cluster (every apiserver writes with it, migration verified), remove the old key once the guard allows it, and wait until every apiserver runs the final file. Re-running after an interruption continues the rotation in progress. Needs --etcd-servers.")
	fs.StringVar(&w.prefix, "coordination-prefix", "", "The apiservers' --coordination-prefix (--wait). Default: the apiservers' default for --etcd-prefix ("+coordination.DefaultPrefix+" for /registry).")
	fs.DurationVar(&w.timeout, "wait-timeout", 30*time.Minute, "Give up --wait after this long, saying which stage is missing what.")
	fs.Var(w.progress, "progress", "Output of --wait: bar (one updating line), plain (a timestamped line per stage, for CI logs), or auto (bar on a terminal).")
	fs.BoolVar(&w.removeIdentity, "remove-identity-fallback", false, "With --wait: also remove identity from behind the new write key in the second edit, once no object is stored in plaintext. By default identity stays as the fallback for values written before encryption.")
	fs.DurationVar(&w.interval, "wait-interval", 500*time.Millisecond, "How often --wait reads the file and etcd.")
	_ = fs.MarkHidden("wait-interval")
}

// rotateWait is rotate --wait: driveRotation, its progress printed by waitOutput.
func (c *common) rotateWait(cmd *cobra.Command, r rotation.Request, w waitOptions) error {
	if len(c.etcd.Servers) == 0 {
		return errors.New("--wait needs --etcd-servers: it follows the apiservers through the coordination keys in etcd")
	}
	w.prefix = c.coordinationPrefix(w.prefix)
	if err := coordination.ValidatePrefix(w.prefix, c.etcdPrefix); err != nil {
		return err
	}
	start := time.Now()
	out := &waitOutput{p: progress.New(cmd.OutOrStdout(), w.progress.Mode()), start: start}
	defer out.p.Done()
	out.linef("following the rotation of %s through %s under %s (timeout %s)", c.sourceName(), strings.Join(c.etcd.Servers, ","), w.prefix, w.timeout)
	err := c.driveRotation(cmd.Context(), drive{
		request: r, prefix: w.prefix, timeout: w.timeout, interval: w.interval,
		removeIdentity: w.removeIdentity, stderr: cmd.ErrOrStderr(),
	}, out)
	if err == nil {
		out.linef("done in %s", time.Since(start).Round(time.Millisecond))
	}
	return err
}

// storedCounts takes the inventory the machine decides from: every resource stored
// under the file's rules and under the rules the first edit would change, and
// --resources, read with the file's own transformers. It also returns the key id hash
// each KMS v2 provider's plugin reports.
func (c *common) storedCounts(ctx context.Context, s *session, f *rotation.File, fr rotation.FileRead) ([]rotation.StoredCount, map[string]string, error) {
	names := slices.Clone(fr.Rotates)
	for _, rule := range fr.Rules {
		names = append(names, rule.Stored...)
	}
	res, err := c.withResources(ctx, s.etcd, names)
	if err != nil {
		return nil, nil, err
	}
	l, err := c.build(ctx, f.Config, false)
	if err != nil {
		return nil, nil, err
	}
	defer l.set.Close()
	inv, err := c.inventoryOf(ctx, s.etcd, l, false, res)
	if err != nil {
		return nil, nil, err
	}
	var counts []rotation.StoredCount
	for _, ri := range inv.Resources {
		counts = append(counts, rotation.StoredCount{Resource: ri.Resource, Objects: ri.Objects, Stale: ri.Stale, Plaintext: ri.Plaintext})
	}
	ids := map[string]string{}
	for _, k := range l.set.KMSProviders() {
		ids[k.Name()] = k.Status().KeyIDHash
	}
	return counts, ids, nil
}

// withKeyIDs is fr with the key id hash their plugin reports (ids, by provider name) on
// its KMS v2 write entries: the file names a provider, the plugin the key id.
func withKeyIDs(fr rotation.FileRead, ids map[string]string) rotation.FileRead {
	fr.Rules = slices.Clone(fr.Rules)
	for i, rule := range fr.Rules {
		if w := rule.Entries[0]; w.Provider == transformers.ProviderKMSv2 && w.KeyIDHash == "" && ids[w.Key] != "" {
			rule.Entries = slices.Clone(rule.Entries)
			rule.Entries[0].KeyIDHash = ids[w.Key]
			fr.Rules[i] = rule
		}
	}
	return fr
}

// removeRefused is the machine's event for a refused second edit: the guard that
// refused, and for the backup-retention guard when the last key it holds may go.
func removeRefused(err error) rotation.RemoveRefused {
	ev := rotation.RemoveRefused{Reason: oneLine(err.Error())}
	var rerr *guard.RefusedError
	if errors.Is(err, errRetentionUnknown) {
		ev.Guard = guard.Retention
	}
	if errors.As(err, &rerr) {
		ev.Guard = rerr.Check
		for _, h := range rerr.Holds {
			if h.Until.After(ev.Until) {
				ev.Until = h.Until
			}
		}
	}
	return ev
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func stageText(s rotation.Stage) string {
	if n := s.Number(); n >= 1 && n <= rotation.Stages {
		return fmt.Sprintf("stage %d/%d (%s)", n, rotation.Stages, s)
	}
	return "the " + s.String() + " stage"
}

// waitOutput shows the machine's output: every transition a timestamped line; on a
// terminal a status line below them with the stage, a bar and what is missing;
// elsewhere what the stage waits for, when it changes (at most every 5 s) and every
// 30 s. Names, hashes and counts only: Ready carries no key material.
type waitOutput struct {
	p     *progress.Writer
	start time.Time
	// lastWaiting is the last waiting line printed (plain).
	lastWaiting string
}

const (
	waitingChangedEvery = 5 * time.Second
	waitingEvery        = 30 * time.Second
)

// linef prints one transition line. Lines and the status line carry what members
// published in etcd (ids, errors, key names), so both are made printable here.
func (o *waitOutput) linef(format string, args ...any) {
	o.p.Line(errtext.Printable(time.Now().UTC().Format(time.RFC3339) + " rotate: " + fmt.Sprintf(format, args...)))
}

// notef prints a transient problem (plain only; the bar shows the stage anyway).
func (o *waitOutput) notef(format string, args ...any) {
	if o.p.Mode() != progress.Bar {
		o.linef(format, args...)
	}
}

// The rotationObserver of rotate --wait.

func (o *waitOutput) Line(s string) { o.linef("%s", s) }
func (o *waitOutput) Note(s string) { o.notef("%s", s) }
func (o *waitOutput) Round(r rotationRound) error {
	o.update(r.Ready)
	return nil
}
func (o *waitOutput) Edited(bool, *rotation.Edit) error { return nil }

func (o *waitOutput) update(rd rotation.Ready) {
	for _, l := range rd.Lines {
		o.linef("%s", l)
	}
	if rd.Action != rotation.ActionWait {
		return
	}
	if o.p.Mode() == progress.Bar {
		o.p.Status(errtext.Printable(statusLine(rd, time.Since(o.start))), false)
		return
	}
	since := o.p.SinceLine()
	if rd.Waiting != "" && ((rd.Waiting != o.lastWaiting && since >= waitingChangedEvery) || since >= waitingEvery) {
		o.linef("%s waits: %s", stageText(rd.Stage), rd.Waiting)
		o.lastWaiting = rd.Waiting
	}
}

// statusLine is the bar's line: stage k/4, objects migrated or apiservers done, the
// elapsed time and what is missing.
func statusLine(rd rotation.Ready, elapsed time.Duration) string {
	var b strings.Builder
	fmt.Fprintf(&b, "rotate [%d/%d %s] ", max(rd.Stage.Number(), 0), rotation.Stages, rd.Stage)
	pr := rd.Progress
	frac, what := 0.0, ""
	switch {
	case pr.Total > 0:
		frac, what = float64(pr.Done)/float64(pr.Total), fmt.Sprintf("%d/%d objects", pr.Done, pr.Total)
	case pr.Members > 0:
		frac, what = float64(pr.Acked)/float64(pr.Members), fmt.Sprintf("%d/%d apiservers", pr.Acked, pr.Members)
	}
	fmt.Fprintf(&b, "%s %s | %s", progress.Fill(frac, 24), what, elapsed.Round(time.Second))
	if rd.Waiting != "" {
		w := []rune(rd.Waiting)
		if len(w) > 60 {
			w = append(w[:57], []rune("...")...)
		}
		b.WriteString(" | " + string(w))
	}
	return b.String()
}
