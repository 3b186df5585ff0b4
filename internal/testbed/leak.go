package testbed

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
)

// ownerEnv marks every process Start runs (and, through the environment, whatever
// those start) with the id of the test process that started it.
const ownerEnv = "REKEY_TESTBED_OWNER"

// LeakedProcess is a process that carries this test process's owner mark.
type LeakedProcess struct {
	PID     int
	Command string
}

func (l LeakedProcess) String() string { return fmt.Sprintf("%d (%s)", l.PID, l.Command) }

// Leaked lists the live processes that this process started through Start, or that
// those started, and that are still running: a test that stops what it started leaves
// none. Zombies (exited, not yet reaped) do not count.
func Leaked() ([]LeakedProcess, error) {
	return leakedOf(os.Getpid())
}

// KillLeaked kills every process Leaked lists and returns them, so that a package's
// TestMain can fail on a leak without leaving it behind for the next run.
func KillLeaked() ([]LeakedProcess, error) {
	leaked, err := Leaked()
	for _, l := range leaked {
		_ = syscall.Kill(l.PID, syscall.SIGCONT)
		_ = syscall.Kill(l.PID, syscall.SIGKILL)
	}
	return leaked, err
}

func leakedOf(owner int) ([]LeakedProcess, error) {
	mark := []byte(ownerEnv + "=" + strconv.Itoa(owner))
	dirs, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("listing processes: %w", err)
	}
	var out []LeakedProcess
	for _, d := range dirs {
		pid, err := strconv.Atoi(d.Name())
		if err != nil || pid == owner {
			continue
		}
		env, err := os.ReadFile(filepath.Join("/proc", d.Name(), "environ"))
		if err != nil || !hasEnvEntry(env, mark) {
			continue // gone, or not ours to read
		}
		stat, err := os.ReadFile(filepath.Join("/proc", d.Name(), "stat"))
		if err != nil || zombie(stat) {
			continue
		}
		cmd, _ := os.ReadFile(filepath.Join("/proc", d.Name(), "cmdline"))
		out = append(out, LeakedProcess{PID: pid, Command: commandLine(cmd)})
	}
	return out, nil
}

// hasEnvEntry reports whether the NUL-separated environment env holds entry exactly.
func hasEnvEntry(env, entry []byte) bool {
	for _, e := range bytes.Split(env, []byte{0}) {
		if bytes.Equal(e, entry) {
			return true
		}
	}
	return false
}

// zombie reads the state field of /proc/<pid>/stat (after the command's closing
// parenthesis).
func zombie(stat []byte) bool {
	i := bytes.LastIndexByte(stat, ')')
	return i >= 0 && i+2 < len(stat) && stat[i+2] == 'Z'
}

func commandLine(cmdline []byte) string {
	s := strings.TrimRight(strings.ReplaceAll(string(cmdline), "\x00", " "), " ")
	if len(s) > 120 {
		s = s[:120] + "…"
	}
	return s
}

// MainWithLeakCheck runs a package's tests (m.Run's exit code) and then fails the run
// when any process the tests started is still running; it kills those first, so that a
// leak never outlives the run that caused it. Use it from TestMain:
//
//	func TestMain(m *testing.M) { os.Exit(testbed.MainWithLeakCheck(m.Run)) }
func MainWithLeakCheck(run func() int) int {
	code := run()
	leaked, err := KillLeaked()
	if err != nil {
		fmt.Fprintf(os.Stderr, "testbed: checking for leaked processes: %v\n", err)
		return max(code, 1)
	}
	if len(leaked) > 0 {
		fmt.Fprintf(os.Stderr, "testbed: FAIL: %d processes started by the tests were still running at the end (killed now): %v\n", len(leaked), leaked)
		return max(code, 1)
	}
	return code
}
