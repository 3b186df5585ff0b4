package main

import (
	"os"
	"slices"
	"testing"
)

// TestMain lets the test binary be rekey: rekey inventory --snapshot runs its own
// binary (here, this one) as "rekey inventory snapshot-reader DB", and the tests of the
// exit status and of the process's FIPS mode run it as "rekey <command> …". No test
// binary flag starts with a word.
func TestMain(m *testing.M) {
	if len(os.Args) > 1 && slices.Contains([]string{"inventory", "check-config", "fleet"}, os.Args[1]) {
		os.Exit(execute(newRootCommand()))
	}
	os.Exit(m.Run())
}
