package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strings"
	"sync"
	"time"
)

// The rotation scenario's rekey side: `rekey rotate --wait`, built from this tree or
// given, run once on the source file.

// errNoWait is what the rekey side reports when the rekey binary predates rotate --wait.
var errNoWait = errors.New("rotate --wait not supported by this rekey binary: build cmd/rekey from a commit that has it")

// checkRotateWait returns errNoWait when `rekey rotate --help` lists no --wait.
func checkRotateWait(ctx context.Context, bin string) error {
	out, err := exec.CommandContext(ctx, bin, "rotate", "--help").CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s rotate --help: %w\n%s", bin, err, out)
	}
	if !rotateHelpHasWait(string(out)) {
		return errNoWait
	}
	return nil
}

// rotateHelpHasWait says whether a help text lists the --wait flag (not merely mentions
// it).
func rotateHelpHasWait(help string) bool {
	for _, l := range strings.Split(help, "\n") {
		f := strings.Fields(l)
		if len(f) > 0 && (f[0] == "--wait" || strings.HasPrefix(f[0], "--wait=")) {
			return true
		}
	}
	return false
}

// rotateRekey runs `rekey rotate --wait` on the source file and returns when it exited
// 0 and every apiserver reports the final config's hash.
func rotateRekey(ctx context.Context, progress io.Writer, b *hostedBed, bin, source string) (time.Time, []byte, error) {
	cmd := exec.CommandContext(ctx, bin, "rotate", "--encryption-provider-config", source, "--wait",
		"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--progress", "plain")
	pr, pw := io.Pipe()
	cmd.Stdout, cmd.Stderr = pw, pw
	var tail tailBuffer
	copied := make(chan struct{})
	go func() {
		defer close(copied)
		sc := bufio.NewScanner(pr)
		for sc.Scan() {
			fmt.Fprintf(progress, "rotation: rekey rotate: %s\n", sc.Text())
			tail.add(sc.Text())
			// The clients' rewrite window is rotate's migrate stage.
			switch {
			case strings.Contains(sc.Text(), "stage 2/4 migrate:"):
				b.clients.rewrite(true)
			case strings.Contains(sc.Text(), "stage 3/4 remove:"):
				b.clients.rewrite(false)
			}
		}
		_, _ = io.Copy(io.Discard, pr)
	}()
	err := cmd.Run()
	exited := time.Now()
	pw.Close()
	<-copied
	if err != nil {
		if strings.Contains(tail.String(), "unknown flag: --wait") {
			return time.Time{}, nil, errNoWait
		}
		return time.Time{}, nil, fmt.Errorf("rekey rotate --wait: %w\n%s", err, tail.String())
	}
	final, err := os.ReadFile(source)
	if err != nil {
		return time.Time{}, nil, err
	}
	// rotate's exit claims every apiserver serves the final config; the metric each
	// apiserver exposes must agree (it may only lag by the poll below).
	seen, err := waitConfigHash(ctx, b.fleet, final, 30*time.Second)
	if err != nil {
		return time.Time{}, nil, fmt.Errorf("rekey rotate --wait exited 0, but: %w", err)
	}
	if seen.After(exited) {
		exited = seen
	}
	return exited, final, nil
}

// tailBuffer keeps the last lines of a command's output for an error.
type tailBuffer struct {
	mu    sync.Mutex
	lines []string
}

func (t *tailBuffer) add(l string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.lines = append(t.lines, l)
	if len(t.lines) > 40 {
		t.lines = t.lines[1:]
	}
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return strings.Join(t.lines, "\n")
}
