//go:build !unix

package config

import "os"

// openNonBlocking opens path for reading; platforms without unix FIFOs need no flag.
func openNonBlocking(path string) (*os.File, error) {
	return os.Open(path)
}
