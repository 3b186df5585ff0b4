package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"

	"github.com/rekey-io/rekey/internal/testbed"
)

// processRun is what a scenario of processes (etcd, shims) starts with: a context an
// interrupt cancels, so an interrupted run stops its processes (their own process
// groups do not get the terminal's signal); a scratch directory; the progress writer;
// and the testbed's binaries, built into the directory.
type processRun struct {
	ctx      context.Context
	dir      string
	progress io.Writer
	bins     testbed.Binaries
	stop     context.CancelFunc
}

// startProcessRun builds the testbed's binaries into a new scratch directory named
// after tmpPrefix; building is announced on the progress writer as announce.
func startProcessRun(s Settings, tmpPrefix, announce string) (r *processRun, err error) {
	r = &processRun{progress: s.Progress}
	if r.progress == nil {
		r.progress = io.Discard
	}
	r.ctx, r.stop = signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	if r.dir, err = os.MkdirTemp("", tmpPrefix); err != nil {
		r.stop()
		return nil, err
	}
	fmt.Fprintln(r.progress, announce)
	if r.bins, err = testbed.Build(r.ctx, filepath.Join(r.dir, "bin")); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// close removes the scratch directory and stops listening for interrupts.
func (r *processRun) close() {
	os.RemoveAll(r.dir)
	r.stop()
}
