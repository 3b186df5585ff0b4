// Package leakcheck checks that tests leave no goroutine behind, as goleak does, with
// time for the goroutines that end shortly after a Close (gRPC transports, etcd's
// client, fsnotify readers) to end on a loaded machine.
//
// goleak v1.3.0 retries for about 0.4 s in all and has no option to wait longer; a test
// process starved of CPU for longer than that (the race group of the test run beside
// three others on two cores) reported goroutines that were on their way out. A check
// run from TestMain fails the package without naming a test.
package leakcheck

import (
	"fmt"
	"os"
	"testing"
	"time"

	"go.uber.org/goleak"
)

// Wait is how long a check waits for the goroutines to end before it reports them.
const Wait = 10 * time.Second

// find polls goleak.Find until it finds nothing or Wait has passed, and returns its
// last error.
func find(opts ...goleak.Option) error {
	deadline := time.Now().Add(Wait)
	for {
		err := goleak.Find(opts...)
		if err == nil || time.Now().After(deadline) {
			return err
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// Verify fails t when goroutines other than the test's own are left after Wait.
func Verify(t testing.TB, opts ...goleak.Option) {
	t.Helper()
	if err := find(opts...); err != nil {
		t.Error(err)
	}
}

// Main runs the package's tests and then fails the run when goroutines are left after
// Wait (as goleak.VerifyTestMain).
func Main(m *testing.M, opts ...goleak.Option) {
	code := m.Run()
	if code == 0 {
		if err := find(opts...); err != nil {
			fmt.Fprintf(os.Stderr, "leakcheck: goroutines left after the tests (waited %v): %v\n", Wait, err)
			code = 1
		}
	}
	os.Exit(code)
}
