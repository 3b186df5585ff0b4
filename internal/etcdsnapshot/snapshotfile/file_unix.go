//go:build unix

package snapshotfile

import (
	"errors"
	"fmt"
	"os"
	"syscall"
)

// openSnapshot opens path for reading without blocking (opening a FIFO for reading
// waits for a writer otherwise) and takes a shared lock on it without waiting: a live
// etcd member holds an exclusive one on its database, and a copy of a database being
// written is torn. A file system without flock (ENOLCK, EINVAL) is read unlocked.
func openSnapshot(path string) (*os.File, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_SH|syscall.LOCK_NB); errors.Is(err, syscall.EWOULDBLOCK) {
		_ = f.Close()
		return nil, fmt.Errorf("%s is locked by another process, as a running etcd member locks its database: take a snapshot with etcdctl snapshot save and read that", path)
	}
	return f, nil
}
