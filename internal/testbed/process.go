package testbed

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/rekey-io/rekey/internal/freeport"
)

// VersionLDFlags stamps binaries with a Kubernetes version kubectl can parse; the
// Makefile's VERSION_LDFLAGS are the same.
const VersionLDFlags = "-X k8s.io/component-base/version.gitVersion=v1.37.2 -X k8s.io/component-base/version.gitMajor=1 -X k8s.io/component-base/version.gitMinor=37"

// Binaries are the paths of the testbed's programs.
type Binaries struct {
	Shim, Etcd, Plugin string
}

// ModuleRoot returns the directory of this module's go.mod.
func ModuleRoot() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("not inside the rekey module")
	}
	return filepath.Dir(mod), nil
}

// PrebuiltEnv names a directory into which the testbed's programs are being built, or
// were, from this tree (hack/test.sh builds them once, with hack/tools/testbins, while
// its test groups start): Build, BuildKubeAPIServer and BuildRekey wait for the set
// they need there (marked ready by ReadyMarker) instead of building it again, and build
// it themselves when that build ended without it (DoneMarker). Outside FIPS mode only:
// FIPS mode builds other binaries. The default test run built dist/kube-apiserver twice
// at once, in two test groups, 3 minutes of both cores.
const PrebuiltEnv = "REKEY_TESTBED_PREBUILT"

// Prebuilt sets and their markers in PrebuiltEnv's directory.
const (
	PrebuiltServers       = "servers"        // the shim, etcd, the KMS plugin and rekey
	PrebuiltKubeAPIServer = "kube-apiserver" // dist/kube-apiserver and upstream's
	// DoneMarker is written when the prebuild ended, whether or not every set was built.
	DoneMarker = ".done"
)

// ReadyMarker is the file that says set is built.
func ReadyMarker(set string) string { return ".ready-" + set }

// prebuiltWait bounds the wait for a prebuilt set: a cold build of k8s.io/kubernetes
// takes many minutes.
const prebuiltWait = 30 * time.Minute

// prebuilt waits for set in PrebuiltEnv's directory and returns the directory once it
// is ready and holds names; "" when the variable is unset, in FIPS mode, or when the
// prebuild ended (or took too long) without it.
func prebuilt(set string, names ...string) string {
	dir := os.Getenv(PrebuiltEnv)
	if dir == "" || FIPS() {
		return ""
	}
	exists := func(n string) bool { _, err := os.Stat(filepath.Join(dir, n)); return err == nil }
	for deadline := time.Now().Add(prebuiltWait); !exists(ReadyMarker(set)); time.Sleep(500 * time.Millisecond) {
		if exists(DoneMarker) || time.Now().After(deadline) {
			return ""
		}
	}
	for _, n := range names {
		if !exists(n) {
			return ""
		}
	}
	return dir
}

// Build compiles the shim, the etcd wrapper and the KMS plugin into dir with
// VersionLDFlags: in one go invocation (the links run in parallel), or, in FIPS mode
// (FIPS), the shim and the plugin with the FIPS module (BuildEnv) and etcd without.
// With PrebuiltEnv set, it returns those already built there.
func Build(ctx context.Context, dir string) (Binaries, error) {
	if pre := prebuilt(PrebuiltServers, "apiserver-shim", "etcd", "kms-plugin"); pre != "" {
		return binariesIn(pre), nil
	}
	root, err := ModuleRoot()
	if err != nil {
		return Binaries{}, err
	}
	builds := [][]string{{"./cmd/apiserver-shim", "./hack/tools/etcd", "./cmd/kms-plugin"}}
	envs := [][]string{os.Environ()}
	if FIPS() {
		builds = [][]string{{"./cmd/apiserver-shim", "./cmd/kms-plugin"}, {"./hack/tools/etcd"}}
		envs = [][]string{BuildEnv(), fixtureBuildEnv()}
	}
	for i, pkgs := range builds {
		cmd := exec.CommandContext(ctx, "go", append([]string{"build", "-ldflags", VersionLDFlags, "-o", dir + string(filepath.Separator)}, pkgs...)...)
		cmd.Dir = root
		cmd.Env = envs[i]
		if out, err := cmd.CombinedOutput(); err != nil {
			return Binaries{}, fmt.Errorf("go build: %w\n%s", err, out)
		}
	}
	return binariesIn(dir), nil
}

// binariesIn are the servers' paths in dir, as Build writes them.
func binariesIn(dir string) Binaries {
	return Binaries{
		Shim:   filepath.Join(dir, "apiserver-shim"),
		Etcd:   filepath.Join(dir, "etcd"),
		Plugin: filepath.Join(dir, "kms-plugin"),
	}
}

// BuildRekey compiles cmd/rekey into dir with VersionLDFlags (and the FIPS module in
// FIPS mode) and returns its path; with PrebuiltEnv set, the one already built there.
func BuildRekey(ctx context.Context, dir string) (string, error) {
	if pre := prebuilt(PrebuiltServers, "rekey"); pre != "" {
		return filepath.Join(pre, "rekey"), nil
	}
	root, err := ModuleRoot()
	if err != nil {
		return "", err
	}
	path := filepath.Join(dir, "rekey")
	cmd := exec.CommandContext(ctx, "go", "build", "-ldflags", VersionLDFlags, "-o", path, "./cmd/rekey")
	cmd.Dir = root
	cmd.Env = BuildEnv()
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("go build ./cmd/rekey: %w\n%s", err, out)
	}
	return path, nil
}

// Process is a started program. Its output goes to LogPath.
type Process struct {
	Name    string
	LogPath string
	cmd     *exec.Cmd
	done    chan struct{}
	err     error
}

// keepLogsEnv names a directory where every process's log is written instead of the
// test's temporary directory (which is removed when the test ends), for a developer
// who wants to read the logs of a passing run.
const keepLogsEnv = "REKEY_TESTBED_KEEP_LOGS"

// Start runs bin with args in RunEnv (FIPS mode, enforced, when the testbed is in it);
// stdout and stderr go to <logDir>/<name>.log, or to
// $REKEY_TESTBED_KEEP_LOGS/<name>-<time>.log when that is set.
func Start(name, logDir, bin string, args ...string) (*Process, error) {
	return StartEnv(name, logDir, bin, RunEnv(), args...)
}

// StartEnv is Start with the environment env (RunEnv plus entries, for instance).
func StartEnv(name, logDir, bin string, env []string, args ...string) (*Process, error) {
	logPath := filepath.Join(logDir, name+".log")
	if keep := os.Getenv(keepLogsEnv); keep != "" {
		if err := os.MkdirAll(keep, 0o755); err != nil {
			return nil, fmt.Errorf("starting %s: the log directory $%s: %w", name, keepLogsEnv, err)
		}
		logPath = filepath.Join(keep, fmt.Sprintf("%s-%s.log", name, time.Now().Format("150405.000000")))
	}
	logFile, err := os.OpenFile(logPath, os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
	if err != nil {
		return nil, fmt.Errorf("starting %s: its log: %w", name, err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Stdout, cmd.Stderr = logFile, logFile
	// The owner mark lets Leaked find this process and everything it starts, even
	// after the test process lost track of it.
	cmd.Env = append(env, ownerEnv+"="+strconv.Itoa(os.Getpid()))
	// Own process group: a Ctrl-C in the test's terminal does not reach it first, and
	// Stop can signal whatever it started along with it.
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("starting %s: %w", name, err)
	}
	p := &Process{Name: name, LogPath: logPath, cmd: cmd, done: make(chan struct{})}
	go func() {
		p.err = cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	return p, nil
}

// PID is the process id.
func (p *Process) PID() int { return p.cmd.Process.Pid }

// Done is closed when the process has exited.
func (p *Process) Done() <-chan struct{} { return p.done }

// ExitErr is the process's exit error once Done is closed.
func (p *Process) ExitErr() error {
	<-p.done
	return p.err
}

// Stop sends SIGTERM to the process and waits up to timeout, then SIGKILL. A stopped
// process (SIGSTOP) gets SIGCONT too: it would not see the SIGTERM before. Whatever
// else is left in its process group when it exits is killed. Safe to call more than
// once and after the process exited.
func (p *Process) Stop(timeout time.Duration) {
	defer p.killGroup()
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(p.PID(), syscall.SIGTERM)
	_ = syscall.Kill(p.PID(), syscall.SIGCONT)
	select {
	case <-p.done:
	case <-time.After(timeout):
		_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
		<-p.done
	}
}

// Kill sends SIGKILL to the process and its process group and waits for it.
func (p *Process) Kill() {
	defer p.killGroup()
	select {
	case <-p.done:
		return
	default:
	}
	_ = syscall.Kill(-p.PID(), syscall.SIGKILL)
	<-p.done
}

// Pause stops the process with SIGSTOP, as a frozen VM or a debugger would: it keeps
// its sockets and leases but runs nothing until Resume.
func (p *Process) Pause() error { return syscall.Kill(p.PID(), syscall.SIGSTOP) }

// Resume continues a paused process (SIGCONT).
func (p *Process) Resume() error { return syscall.Kill(p.PID(), syscall.SIGCONT) }

// killGroup kills what the process started in its own process group (it leads the
// group: Start sets Setpgid). ESRCH, an empty group, is the usual answer.
func (p *Process) killGroup() { _ = syscall.Kill(-p.PID(), syscall.SIGKILL) }

// Log returns the last max bytes of the process's output.
func (p *Process) Log(max int) string {
	b, _ := os.ReadFile(p.LogPath)
	if len(b) > max {
		b = b[len(b)-max:]
	}
	return string(b)
}

// FreePort returns a loopback TCP port that was free a moment ago, below the ephemeral
// range (internal/freeport says why).
func FreePort() (int, error) { return freeport.Pick() }

// lostPortAttempts is how often a start that lost its port is tried on new ones.
const lostPortAttempts = 4

// retryLostPort runs start, which picks its ports with FreePort, again when its
// process failed to bind one: between the pick and the bind another process (a test
// package running beside this one) may take the port. A program that must know its
// peers' ports before it starts (etcd) cannot bind port 0, so the start is tried
// again on fresh ports instead.
func retryLostPort[T any](start func() (T, error)) (T, error) {
	for attempt := 1; ; attempt++ {
		v, err := start()
		if err == nil || attempt == lostPortAttempts || !strings.Contains(err.Error(), "address already in use") {
			return v, err
		}
	}
}

// poll calls f every interval until it returns nil, ctx ends or p exits.
func poll(ctx context.Context, p *Process, interval time.Duration, f func() error) error {
	for {
		err := f()
		if err == nil {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("%w (last: %v)", ctx.Err(), err)
		case <-p.Done():
			return fmt.Errorf("%s exited (%v); log tail:\n%s", p.Name, p.ExitErr(), p.Log(4000))
		case <-time.After(interval):
		}
	}
}

// RSS returns the resident set size of pid in bytes (Linux).
func RSS(pid int) (int64, error) { return procStatusBytes(pid, "VmRSS") }

// PeakRSS returns the peak resident set size of pid in bytes (Linux's VmHWM: the high
// water mark since the process started).
func PeakRSS(pid int) (int64, error) { return procStatusBytes(pid, "VmHWM") }

// procStatusBytes reads a "<field>: N kB" line of /proc/<pid>/status.
func procStatusBytes(pid int, field string) (int64, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0, err
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, field+":"); ok {
			var kb int64
			if _, err := fmt.Sscanf(strings.TrimSpace(rest), "%d kB", &kb); err != nil {
				return 0, err
			}
			return kb * 1024, nil
		}
	}
	return 0, fmt.Errorf("/proc/%d/status has no %s", pid, field)
}

// CPUTime is the CPU time (user and system) the process has used so far, from
// /proc/<pid>/stat. Linux reports it in clock ticks of 1/100 s (USER_HZ, fixed at 100
// for user space on every architecture Go supports).
func CPUTime(pid int) (time.Duration, error) {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0, err
	}
	// The command name (field 2) is in parentheses and may hold spaces: count the
	// fields after its closing parenthesis (state is field 3; utime 14, stime 15).
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 13 {
		return 0, fmt.Errorf("/proc/%d/stat: %d fields after the command name, want at least 13", pid, len(f))
	}
	var ticks int64
	for _, s := range f[11:13] {
		v, err := strconv.ParseInt(s, 10, 64)
		if err != nil {
			return 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
		}
		ticks += v
	}
	return time.Duration(ticks) * 10 * time.Millisecond, nil
}
