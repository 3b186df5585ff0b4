//go:build !unix

package snapshotfile

import "os"

// openSnapshot opens path for reading.
func openSnapshot(path string) (*os.File, error) { return os.Open(path) }
