package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	apiserverv1 "k8s.io/apiserver/pkg/apis/apiserver/v1"

	stages "github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
)

// waitOptions are rotate's --wait flags.
type waitOptions struct {
	wait     bool
	prefix   string
	timeout  time.Duration
	progress string
	// interval is how often the file and etcd are read.
	interval time.Duration
}

func (w *waitOptions) addFlags(fs *pflag.FlagSet) {
	fs.BoolVar(&w.wait, "wait", false, "Run the whole rotation: write the new key first, follow the cluster (every apiserver writes with it, migration verified), remove the old key once the guard allows it, and wait until every apiserver runs the final file. Re-running after an interruption continues the rotation in progress. Needs --etcd-servers.")
	fs.StringVar(&w.prefix, "coordination-prefix", cluster.DefaultPrefix, "The apiservers' --coordination-prefix (--wait).")
	fs.DurationVar(&w.timeout, "wait-timeout", 30*time.Minute, "Give up --wait after this long, saying which stage is missing what.")
	fs.StringVar(&w.progress, "progress", "auto", "Output of --wait: bar (one updating line), plain (a timestamped line per stage, for CI logs), or auto (bar on a terminal).")
	fs.DurationVar(&w.interval, "wait-interval", 500*time.Millisecond, "How often --wait reads the file and etcd.")
	_ = fs.MarkHidden("wait-interval")
}

// rotateWait drives stages.Machine: it reads the file and the coordination keys every
// interval, feeds them, and does what the machine asks.
func (c *common) rotateWait(cmd *cobra.Command, r rotation, w waitOptions) error {
	if len(c.etcdServers) == 0 {
		return errors.New("--wait needs --etcd-servers: it follows the apiservers through the coordination keys in etcd")
	}
	if err := cluster.ValidatePrefix(w.prefix, c.etcdPrefix); err != nil {
		return err
	}
	out := cmd.OutOrStdout()
	bar := false
	switch w.progress {
	case "bar":
		bar = true
	case "plain":
	case "auto":
		bar = isTerminal(out)
	default:
		return fmt.Errorf("--progress %q: use auto, bar or plain", w.progress)
	}
	if w.interval <= 0 {
		w.interval = 500 * time.Millisecond
	}
	ctx := cmd.Context()
	cli, err := c.client(ctx)
	if err != nil {
		return err
	}
	defer cli.Close()

	start := time.Now()
	p := &progressWriter{w: out, bar: bar, start: start, timeout: w.timeout}
	m := stages.New(stages.Config{Timeout: w.timeout}, start)
	p.plainf("following the rotation of %s through %s under %s (timeout %s)", c.configPath, strings.Join(c.etcdServers, ","), w.prefix, w.timeout)
	ticker := time.NewTicker(w.interval)
	defer ticker.Stop()
	for {
		now := time.Now()
		m.Step(stages.Tick{Now: now})
		fr, err := c.readRotationFile(r.resources)
		if err != nil {
			p.done()
			return err
		}
		m.Step(fr)
		sctx, cancel := context.WithTimeout(ctx, c.timeout)
		snap, err := cluster.ReadSnapshot(sctx, cli, w.prefix)
		cancel()
		if err != nil {
			p.notef("reading the cluster failed (retrying): %v", err)
		} else {
			m.Step(stages.ClusterObserved{Members: snap.Members, Migration: snap.Migration, Prefix: w.prefix})
		}
		rd := m.Ready()
		p.update(rd)
		switch rd.Action {
		case stages.ActionDone:
			p.linef("done in %s", time.Since(start).Round(time.Millisecond))
			return nil
		case stages.ActionFail:
			p.done()
			return fmt.Errorf("rotate --wait: %s", rd.Err)
		case stages.ActionWriteFirstEdit:
			r.now = time.Now()
			summary, hash, err := c.writeFirstEdit(cmd, r, fr.Hash)
			if errors.Is(err, errFileChanged) {
				p.notef("%s changed since it was read; reading it again before the first edit", c.configPath)
				continue
			}
			if err != nil {
				p.done()
				return fmt.Errorf("rotate --wait: writing the first edit: %w", err)
			}
			p.linef("wrote %s: %s (%s)", c.configPath, summary, hash)
			m.Step(stages.FirstEditWritten{})
			continue
		case stages.ActionRemoveOld:
			summary, hash, err := c.writeSecondEdit(cmd, rd.Remove, r.resources, fr.Hash)
			if errors.Is(err, errFileChanged) {
				p.notef("%s changed since it was read; reading it again before the second edit", c.configPath)
				continue
			}
			if err != nil {
				m.Step(stages.RemoveRefused{Reason: oneLine(err.Error())})
				continue
			}
			p.linef("wrote %s: %s (%s)", c.configPath, summary, hash)
			m.Step(stages.RemoveWritten{})
			continue
		}
		select {
		case <-ctx.Done():
			p.done()
			return fmt.Errorf("rotate --wait: interrupted at %s; run it again to continue: %w", stageText(rd.Stage), ctx.Err())
		case <-ticker.C:
		}
	}
}

// readRotationFile reads the file as the machine sees it: its hash and the rules a
// rotation may concern (written with a local key or KMS, named by --resources).
func (c *common) readRotationFile(resources []string) (stages.FileRead, error) {
	data, hash, err := config.ReadFile(c.configPath)
	if err != nil {
		return stages.FileRead{}, err
	}
	if _, err := config.Parse(data, c.configPath, config.Options{Reload: true}); err != nil {
		return stages.FileRead{}, fmt.Errorf("the configuration is not valid now, so rotate --wait stops (fix the file and run it again): %w", err)
	}
	ext, err := decodeExternal(data)
	if err != nil {
		return stages.FileRead{}, err
	}
	fr := stages.FileRead{Hash: hash}
	for _, rc := range ext.Resources {
		if len(rc.Providers) == 0 {
			continue
		}
		if kind := writeProviderType(rc.Providers[0]); !isLocal(kind) && kind != providerKMS {
			continue
		}
		if !namesAny(rc, resources) {
			continue
		}
		fr.Rules = append(fr.Rules, stages.Rule{Resources: slices.Clone(rc.Resources), Entries: ruleEntries(rc)})
	}
	return fr, nil
}

// ruleEntries names a rule's chain the way the apiservers publish it.
func ruleEntries(rc apiserverv1.ResourceConfiguration) []cluster.Key {
	var out []cluster.Key
	for _, p := range rc.Providers {
		kind := writeProviderType(p)
		switch {
		case p.KMS != nil:
			out = append(out, cluster.Key{Provider: providerKMS, Key: p.KMS.Name})
		case p.Identity != nil:
			out = append(out, cluster.Key{Provider: "identity"})
		default:
			for _, k := range keysOf(p) {
				out = append(out, cluster.Key{Provider: kind, Key: k.Name})
			}
		}
	}
	return out
}

// writeFirstEdit puts a new write key first in the file (step 1).
// errFileChanged: the file is not the one the decision to edit it was taken on (another
// rotate, a person, a pipeline wrote it in between); the loop reads it again and decides
// anew, so two edits never stack on one another unseen.
var errFileChanged = errors.New("the configuration file changed since it was read")

func (c *common) writeFirstEdit(cmd *cobra.Command, r rotation, readHash string) (summary, hash string, err error) {
	data, now, err := config.ReadFile(c.configPath)
	if err != nil {
		return "", "", err
	}
	if now != readHash {
		return "", "", errFileChanged
	}
	ext, err := decodeExternal(data)
	if err != nil {
		return "", "", err
	}
	next, summary, err := c.addKey(cmd, ext, r)
	if err != nil {
		return "", "", err
	}
	if err := replaceFile(c.configPath, next); err != nil {
		return "", "", err
	}
	// --wait removes the old key itself: the hint for step 2 does not apply.
	summary, _, _ = strings.Cut(summary, " until `rekey rotate --remove-old")
	return summary, config.Hash(next), nil
}

// writeSecondEdit removes names from the file once the guard allows it (step 2, the same
// path as --remove-old).
func (c *common) writeSecondEdit(cmd *cobra.Command, names, resources []string, readHash string) (summary, hash string, err error) {
	data, now, err := config.ReadFile(c.configPath)
	if err != nil {
		return "", "", err
	}
	if now != readHash {
		return "", "", errFileChanged
	}
	cur, err := config.Parse(data, c.configPath, config.Options{Reload: true})
	if err != nil {
		return "", "", err
	}
	ext, err := decodeExternal(data)
	if err != nil {
		return "", "", err
	}
	next, summary, err := c.removeKeys(cmd, cur, ext, names, resources)
	if err != nil {
		return "", "", err
	}
	if err := replaceFile(c.configPath, next); err != nil {
		return "", "", err
	}
	return summary, config.Hash(next), nil
}

func oneLine(s string) string { return strings.Join(strings.Fields(s), " ") }

func stageText(s stages.Stage) string {
	if n := s.Number(); n >= 1 && n <= stages.Stages {
		return fmt.Sprintf("stage %d/%d (%s)", n, stages.Stages, s)
	}
	return "the " + s.String() + " stage"
}

func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	if !ok {
		return false
	}
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}

// progressWriter renders the machine's output: timestamped lines (plain), or one line
// redrawn in place with the transitions printed above it (bar). Names, hashes and
// counts only: Ready carries no key material.
type progressWriter struct {
	w       io.Writer
	bar     bool
	start   time.Time
	timeout time.Duration
	drawn   bool
	// plain: the last waiting line and when it was printed, so CI logs get a line
	// when the reason changes (at most every 5 s) and every 30 s otherwise.
	lastWaiting string
	lastPrint   time.Time
}

func (p *progressWriter) clear() {
	if p.bar && p.drawn {
		fmt.Fprint(p.w, "\r\033[K")
		p.drawn = false
	}
}

// linef prints one transition line.
func (p *progressWriter) linef(format string, args ...any) {
	p.clear()
	fmt.Fprintf(p.w, "%s rotate: %s\n", time.Now().UTC().Format(time.RFC3339), fmt.Sprintf(format, args...))
	p.lastPrint = time.Now()
}

// plainf prints a line in both modes.
func (p *progressWriter) plainf(format string, args ...any) { p.linef(format, args...) }

// notef prints a transient problem (plain only; the bar shows the stage anyway).
func (p *progressWriter) notef(format string, args ...any) {
	if !p.bar {
		p.linef(format, args...)
	}
}

func (p *progressWriter) update(rd stages.Ready) {
	for _, l := range rd.Lines {
		p.linef("%s", l)
	}
	if rd.Action != stages.ActionWait {
		return
	}
	if p.bar {
		p.draw(rd)
		return
	}
	now := time.Now()
	if rd.Waiting != "" && ((rd.Waiting != p.lastWaiting && now.Sub(p.lastPrint) >= 5*time.Second) || now.Sub(p.lastPrint) >= 30*time.Second) {
		p.linef("%s waits: %s", stageText(rd.Stage), rd.Waiting)
		p.lastWaiting = rd.Waiting
	}
}

func (p *progressWriter) draw(rd stages.Ready) {
	const width = 24
	var b strings.Builder
	n := rd.Stage.Number()
	fmt.Fprintf(&b, "rotate [%d/%d %s] ", max(n, 0), stages.Stages, rd.Stage)
	pr := rd.Progress
	frac, what := 0.0, ""
	switch {
	case pr.Total > 0:
		frac, what = float64(pr.Done)/float64(pr.Total), fmt.Sprintf("%d/%d objects", pr.Done, pr.Total)
	case pr.Members > 0:
		frac, what = float64(pr.Acked)/float64(pr.Members), fmt.Sprintf("%d/%d apiservers", pr.Acked, pr.Members)
	}
	fill := int(frac * width)
	b.WriteString(strings.Repeat("█", fill) + strings.Repeat("░", width-fill) + " " + what)
	fmt.Fprintf(&b, " | %s", time.Since(p.start).Round(time.Second))
	if rd.Waiting != "" {
		w := []rune(rd.Waiting)
		if len(w) > 60 {
			w = append(w[:57], []rune("...")...)
		}
		b.WriteString(" | " + string(w))
	}
	fmt.Fprint(p.w, "\r\033[K"+b.String())
	p.drawn = true
}

// done ends the bar's line.
func (p *progressWriter) done() { p.clear() }
