//go:build unix

package config

import (
	"os"
	"syscall"
)

// openNonBlocking opens path for reading without blocking: opening a FIFO for reading
// waits for a writer unless O_NONBLOCK is set. It has no effect on regular files.
func openNonBlocking(path string) (*os.File, error) {
	return os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
}
