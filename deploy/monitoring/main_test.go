package monitoring

import (
	"os"
	"testing"

	"github.com/rekey-io/rekey/internal/testbed"
)

// TestMain fails the package when a test leaves a process it started running.
func TestMain(m *testing.M) { os.Exit(testbed.MainWithLeakCheck(m.Run)) }
