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

	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/internal/progress"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
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

// rotateWait drives rotation.Machine: it reads the file and the coordination keys every
// interval, feeds them, and does what the machine asks.
func (c *common) rotateWait(cmd *cobra.Command, r rotation.Request, w waitOptions) error {
	if len(c.etcd.Servers) == 0 {
		return errors.New("--wait needs --etcd-servers: it follows the apiservers through the coordination keys in etcd")
	}
	w.prefix = c.coordinationPrefix(w.prefix)
	if err := coordination.ValidatePrefix(w.prefix, c.etcdPrefix); err != nil {
		return err
	}
	if w.interval <= 0 {
		w.interval = 500 * time.Millisecond
	}
	ctx := cmd.Context()
	s, err := c.open(ctx, preamble{})
	if err != nil {
		return err
	}
	defer s.Close()

	start := time.Now()
	out := &waitOutput{p: progress.New(cmd.OutOrStdout(), w.progress.Mode()), start: start}
	defer out.p.Done()
	m := rotation.New(rotation.Config{Timeout: w.timeout, RemoveIdentity: w.removeIdentity}, start)
	// kmsKeyIDs are the key id hashes this command's own KMS plugins report, by
	// provider name, from the last inventory: the key id a KMS rule's rotation waits for.
	var kmsKeyIDs map[string]string
	// stored resolves the file's rules into the resources stored under them (a wildcard
	// rule into what is stored), refreshed at every inventory.
	stored, err := c.scanStored(ctx, s.etcd)
	if err != nil {
		return err
	}
	out.linef("following the rotation of %s through %s under %s (timeout %s)", c.sourceName(), strings.Join(c.etcd.Servers, ","), w.prefix, w.timeout)
	ticker := time.NewTicker(w.interval)
	defer ticker.Stop()
	for {
		m.Step(rotation.Tick{Now: time.Now()})
		f, err := c.readSource(ctx, "the configuration is not valid now, so rotate --wait stops (fix it and run it again)")
		if err != nil {
			return err
		}
		fr := withKeyIDs(f.Read(r, stored.resources), kmsKeyIDs)
		m.Step(fr)
		sctx, cancel := context.WithTimeout(ctx, c.timeout)
		snap, err := cluster.ReadSnapshot(sctx, s.etcd, w.prefix)
		cancel()
		if err != nil {
			out.notef("reading the cluster failed (retrying): %v", err)
		} else {
			m.Step(rotation.ClusterObserved{Members: snap.Members, Migration: snap.Migration, Prefix: w.prefix})
		}
		rd := m.Ready()
		out.update(rd)
		switch rd.Action {
		case rotation.ActionDone:
			out.linef("done in %s", time.Since(start).Round(time.Millisecond))
			return nil
		case rotation.ActionFail:
			return fmt.Errorf("rotate --wait: %s", rd.Err)
		case rotation.ActionTakeInventory:
			if x, err := c.scanStored(ctx, s.etcd); err == nil {
				stored = x
				fr = withKeyIDs(f.Read(r, stored.resources), kmsKeyIDs)
			}
			counts, ids, err := c.storedCounts(ctx, s, f.File, fr)
			if err != nil {
				m.Step(rotation.InventoryFailed{Reason: oneLine(err.Error())})
				continue
			}
			kmsKeyIDs = ids
			m.Step(withKeyIDs(fr, kmsKeyIDs))
			m.Step(rotation.Inventoried{Resources: counts})
			continue
		case rotation.ActionWriteFirstEdit, rotation.ActionRemoveOld:
			if err := c.waitEdit(cmd, m, rd, f, r, out); err != nil {
				return err
			}
			continue
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("rotate --wait: interrupted at %s; run it again to continue: %w", stageText(rd.Stage), ctx.Err())
		case <-ticker.C:
		}
	}
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

// waitEdit makes the edit rd asks for on f, the file as read for this decision, and
// reports the result to m: the first edit (a new write key), or the second (rd.Remove
// out, once the guard allows it; a refusal is the machine's to retry).
func (c *common) waitEdit(cmd *cobra.Command, m *rotation.Machine, rd rotation.Ready, f sourced, r rotation.Request, out *waitOutput) error {
	which := "first"
	var e *rotation.Edit
	var err error
	if rd.Action == rotation.ActionRemoveOld {
		which = "second"
		e, err = c.removeKeys(cmd.Context(), f.File, rd.Remove, r.Resources)
	} else {
		r.Now = time.Now()
		e, err = c.addKey(cmd, f.File, r)
	}
	if err == nil {
		err = c.replaceSource(cmd.Context(), f, e)
	}
	switch {
	case errors.Is(err, configsource.ErrChanged):
		out.notef("%s changed since it was read; reading it again before the %s edit", c.sourceName(), which)
		m.Step(rotation.EditSkipped{})
		return nil
	case err != nil && rd.Action == rotation.ActionRemoveOld:
		m.Step(removeRefused(err))
		return nil
	case err != nil:
		return fmt.Errorf("rotate --wait: writing the first edit: %w", err)
	}
	out.linef("wrote %s: %s (%s)", c.sourceName(), e.Summary, e.Config.Hash)
	if rd.Action == rotation.ActionRemoveOld {
		m.Step(rotation.RemoveWritten{})
	} else {
		m.Step(rotation.FirstEditWritten{})
	}
	return nil
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
