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
//
// It is opened without following a symbolic link (O_NOFOLLOW), and, once open, must be
// a regular file owned by the user running rekey (checked on the open file, so nothing
// can swap it in between): otherwise whoever can write the directory could point the
// lock at another file — created or truncated with the operator's rights — or hold a
// lock rekey would then wait on.
const (
	editLockWait  = 10 * time.Second
	editLockRetry = 20 * time.Millisecond
)

// lockForEdit takes the edit lock of the configuration file path; the caller calls
// unlock once the file is replaced (or left alone).
func lockForEdit(ctx context.Context, path string) (unlock func(), err error) {
	return lockForEditAs(ctx, path, os.Geteuid())
}

// lockForEditAs is lockForEdit for the user uid: the lock file must be theirs.
func lockForEditAs(ctx context.Context, path string, uid int) (unlock func(), err error) {
	target, err := filepath.EvalSymlinks(path)
	if err != nil {
		return nil, fmt.Errorf("resolving %q: %w", path, err)
	}
	lockPath := target + ".lock"
	f, err := openLockFile(lockPath, target, uid)
	if err != nil {
		return nil, err
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

// openLockFile opens (creating it if needed) the lock file lockPath of target without
// following a symbolic link, and checks the open file: a regular file owned by uid.
func openLockFile(lockPath, target string, uid int) (*os.File, error) {
	// O_NONBLOCK: opening a FIFO or a device someone put there must not hang or act
	// before the checks below refuse it.
	f, err := os.OpenFile(lockPath, os.O_RDWR|os.O_CREATE|syscall.O_NOFOLLOW|syscall.O_NONBLOCK, 0o600)
	if errors.Is(err, syscall.ELOOP) {
		return nil, fmt.Errorf("the edit lock %q is a symbolic link, which rekey does not follow (it creates the lock as a plain file): remove the link and run again", lockPath)
	}
	if errors.Is(err, syscall.EISDIR) {
		return nil, fmt.Errorf("the edit lock %q is not a regular file but a directory, which rekey never creates: remove it and run again", lockPath)
	}
	if err != nil {
		return nil, fmt.Errorf("opening the edit lock %q (the directory of %q must be writable, as for the edit itself): %w", lockPath, target, err)
	}
	fi, err := f.Stat()
	if err != nil {
		_ = f.Close()
		return nil, fmt.Errorf("checking the edit lock %q: %w", lockPath, err)
	}
	if !fi.Mode().IsRegular() {
		_ = f.Close()
		return nil, fmt.Errorf("the edit lock %q is not a regular file but a %s, which rekey never creates: remove it and run again", lockPath, fileType(fi.Mode()))
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	if !ok {
		_ = f.Close()
		return nil, fmt.Errorf("checking the owner of the edit lock %q: the file system reports none", lockPath)
	}
	if int(st.Uid) != uid {
		_ = f.Close()
		return nil, fmt.Errorf("the edit lock %q belongs to user id %d, not to the user running rekey (%d): run rekey as the user who edits %q, or remove the lock file if nobody uses it", lockPath, st.Uid, uid, target)
	}
	return f, nil
}

// fileType names a mode's file type for an error.
func fileType(m os.FileMode) string {
	switch {
	case m&os.ModeNamedPipe != 0:
		return "named pipe"
	case m&os.ModeSocket != 0:
		return "socket"
	case m&os.ModeDevice != 0:
		return "device"
	}
	return "special file (" + m.Type().String() + ")"
}
