// Package atomicfile replaces a file so that a crash or a power loss leaves either the
// old content or the new one, never a torn or empty file, and never undoes a save that
// already returned.
//
// Every file rekey writes for an operator or for itself (the encryption configuration
// edited by `rekey rotate`, the applied-state file the start-up check relies on, the
// migration checkpoint) goes through WriteFile.
package atomicfile

import (
	"fmt"
	"os"
	"path/filepath"
	"syscall"
)

// WriteFile writes data to a temporary file next to path, fsyncs it, renames it over
// path and fsyncs the directory, so the rename itself survives a crash. When path
// already exists its mode and owner are kept (perm only applies to a new file); when
// the owner cannot be kept (rekey runs as another, unprivileged user) WriteFile fails
// and leaves path as it was. Symbolic links are resolved first, so the link stays and
// its target is replaced (the layout a kubelet-projected or ConfigMap-mounted file has).
func WriteFile(path string, data []byte, perm os.FileMode) (err error) {
	target, err := filepath.EvalSymlinks(path)
	switch {
	case err == nil:
	case os.IsNotExist(err):
		target = path
	default:
		return fmt.Errorf("resolving %q: %w", path, err)
	}
	mode, uid, gid, keepOwner := perm, 0, 0, false
	if fi, err := os.Stat(target); err == nil {
		mode = fi.Mode().Perm()
		if st, ok := fi.Sys().(*syscall.Stat_t); ok {
			uid, gid, keepOwner = int(st.Uid), int(st.Gid), true
		}
	} else if !os.IsNotExist(err) {
		return fmt.Errorf("reading %q's mode: %w", target, err)
	}

	dir := filepath.Dir(target)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(target)+".tmp-*")
	if err != nil {
		return fmt.Errorf("creating a temporary file next to %q (its directory must be writable): %w", target, err)
	}
	defer func() {
		if err != nil {
			_ = tmp.Close()
			_ = os.Remove(tmp.Name())
		}
	}()
	if err = tmp.Chmod(mode); err != nil {
		return fmt.Errorf("setting the mode of %q: %w", tmp.Name(), err)
	}
	if keepOwner && (uid != os.Getuid() || gid != os.Getgid()) {
		if err = tmp.Chown(uid, gid); err != nil {
			return fmt.Errorf("keeping %q's owner %d:%d (run as that user or root): %w", target, uid, gid, err)
		}
	}
	if _, err = tmp.Write(data); err != nil {
		return fmt.Errorf("writing %q: %w", tmp.Name(), err)
	}
	if err = tmp.Sync(); err != nil {
		return fmt.Errorf("syncing %q: %w", tmp.Name(), err)
	}
	if err = tmp.Close(); err != nil {
		return fmt.Errorf("closing %q: %w", tmp.Name(), err)
	}
	if err = os.Rename(tmp.Name(), target); err != nil {
		return fmt.Errorf("replacing %q: %w", target, err)
	}
	// The rename is durable only once the directory entry is: without this a crash can
	// bring the previous file back after WriteFile returned.
	if err = syncDir(dir); err != nil {
		return fmt.Errorf("syncing directory %q after replacing %q: %w", dir, target, err)
	}
	return nil
}

func syncDir(dir string) error {
	d, err := os.Open(dir)
	if err != nil {
		return err
	}
	defer d.Close()
	return d.Sync()
}
