package main

import (
	"os"
	"testing"

	"k8s.io/component-base/cli"
)

// TestMain lets the test binary be rekey: rekey inventory --snapshot runs its own
// binary (here, this one) as "rekey inventory snapshot-reader DB", and the tests of the
// exit status run it as "rekey inventory …". No test binary flag starts with a word.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && os.Args[1] == "inventory" {
		os.Exit(cli.Run(newRootCommand()))
	}
	os.Exit(m.Run())
}
