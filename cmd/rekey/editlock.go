package main

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"syscall"
	"time"
)

// An edit of the configuration file holds an exclusive flock on "<file>.lock", next to
// the file (after symbolic links, where atomicfile.WriteFile writes), from the read that
// checks the file is still the content the edit was decided on to the rename that
// replaces it. Without it two rotate runs can both pass that check before either
// renames, and the second rename silently drops the first edit.
//
// The lock is taken without blocking and tried again every editLockRetry for up to
// editLockWait: a blocking flock cannot be interrupted by the command's context (Ctrl-C,
// --wait-timeout), and an edit holds the lock only for one read and one write, so a lock
// held longer than editLockWait belongs to a process that is stuck, which the error
// names instead of hanging.
//
// The lock file is created once (mode 0600) and never deleted: a run that deletes it
// while another waits on it lets a third create a new one and lock that, and two runs
// then hold "the" lock at once.
const (
	editLockWait  = 10 * time.Second
	editLockRetry = 20 * time.Millisecond
)

// lockForEdit takes the edit lock of the configuration file path; the caller calls
// unlock once the file is replaced (or left alone).
func lockForEdit(ctx context.Context, path string) (unlock func(), err error) {
	target, err := filepath.EvalSymlinks(path)
	if err != nil {
		return nil, fmt.Errorf("resolving %q: %w", path, err)
	}
	lockPath := target + ".lock"
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE, 0o600)
	if err != nil {
		return nil, fmt.Errorf("opening the edit lock %q (the directory of %q must be writable, as for the edit itself): %w", lockPath, target, err)
	}
	deadline := time.Now().Add(editLockWait)
	for {
		// Closing f releases the lock, also when the process dies.
		err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB)
		if err == nil {
			return func() { _ = f.Close() }, nil
		}
		if !errors.Is(err, syscall.EWOULDBLOCK) && !errors.Is(err, syscall.EINTR) {
			_ = f.Close()
			return nil, fmt.Errorf("locking %q: %w", lockPath, err)
		}
		if time.Now().After(deadline) {
			_ = f.Close()
			return nil, fmt.Errorf("another process has held the edit lock %q for more than %s, while an edit holds it for well under a second: it may be stuck (lsof %s names it)", lockPath, editLockWait, lockPath)
		}
		select {
		case <-ctx.Done():
			_ = f.Close()
			return nil, fmt.Errorf("waiting for the edit lock %q: %w", lockPath, ctx.Err())
		case <-time.After(editLockRetry):
		}
	}
}
