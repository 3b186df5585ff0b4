package etcdtest

import (
	"context"
	"errors"
	"fmt"
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rekey-io/rekey/internal/fipsenv"
)

// BinaryEnv names an etcd binary built from ./hack/tools/etcd without GOFIPS140 (make
// test-fips builds it once); when it is unset, the first member started as a process
// builds it (see etcdBinary).
const BinaryEnv = "REKEY_ETCDTEST_BIN"

// etcd computes its member ids with SHA-1 (membership.computeMemberID), which Go
// refuses under GODEBUG=fips140=only with a panic: an embedded member cannot start in
// that mode. There the member runs as a separate process of a build without the FIPS
// module, with fips140=off. etcd is the tests' fixture, not rekey: the code under test
// (etcd's client, rekey) stays in the test's process, in FIPS mode.

// processEnv is the child's environment: the test's, with fips140=off.
func processEnv() []string { return fipsenv.WithGODEBUG(os.Environ(), "off") }

var built struct {
	once sync.Once
	path string
	err  error
}

// etcdBinary returns $REKEY_ETCDTEST_BIN, or builds ./hack/tools/etcd once per test
// process into a directory per user under the temporary directory (go build relinks
// only when it is stale; a lock file keeps concurrent test binaries apart).
func etcdBinary() (string, error) {
	if p := os.Getenv(BinaryEnv); p != "" {
		return p, nil
	}
	built.once.Do(func() { built.path, built.err = buildEtcd() })
	return built.path, built.err
}

func buildEtcd() (string, error) {
	out, err := exec.Command("go", "env", "GOMOD").Output()
	if err != nil {
		return "", fmt.Errorf("etcdtest: go env GOMOD: %w", err)
	}
	mod := strings.TrimSpace(string(out))
	if mod == "" || mod == os.DevNull {
		return "", errors.New("etcdtest: building etcd: not inside the rekey module")
	}
	dir := filepath.Join(os.TempDir(), "rekey-etcdtest-"+strconv.Itoa(os.Getuid()))
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", fmt.Errorf("etcdtest: %w", err)
	}
	lock, err := os.OpenFile(filepath.Join(dir, "lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return "", fmt.Errorf("etcdtest: %w", err)
	}
	defer lock.Close()
	if err := syscall.Flock(int(lock.Fd()), syscall.LOCK_EX); err != nil {
		return "", fmt.Errorf("etcdtest: locking %s: %w", lock.Name(), err)
	}
	bin := filepath.Join(dir, "etcd")
	cmd := exec.Command("go", "build", "-o", bin, "./hack/tools/etcd")
	cmd.Dir = filepath.Dir(mod)
	// A build of etcd without the FIPS module: the test's GOFIPS140 is not its.
	cmd.Env = append(processEnv(), "GOFIPS140=off")
	if out, err := cmd.CombinedOutput(); err != nil {
		return "", fmt.Errorf("etcdtest: go build ./hack/tools/etcd: %w\n%s", err, out)
	}
	return bin, nil
}

// process is a member running as a child process.
type process struct {
	cmd  *exec.Cmd
	done chan struct{}
}

func (p *process) close() {
	select {
	case <-p.done:
		return
	default:
	}
	_ = p.cmd.Process.Signal(syscall.SIGTERM)
	select {
	case <-p.done:
	case <-time.After(10 * time.Second):
		_ = p.cmd.Process.Kill()
		<-p.done
	}
}

func startProcess(dir string, opts Options, clientURL, peerURL *url.URL, tlsFiles *TLSFiles) (*Server, error) {
	bin, err := etcdBinary()
	if err != nil {
		return nil, err
	}
	args := []string{"--name", "etcdtest", "--data-dir", filepath.Join(dir, "data"),
		"--listen-client-urls", clientURL.String(), "--advertise-client-urls", clientURL.String(),
		"--listen-peer-urls", peerURL.String(), "--initial-advertise-peer-urls", peerURL.String(),
		"--initial-cluster", "etcdtest=" + peerURL.String(),
		"--unsafe-no-fsync", "--log-level", "error"}
	if tlsFiles != nil {
		args = append(args, "--cert-file", tlsFiles.ServerCertFile, "--key-file", tlsFiles.ServerKeyFile,
			"--trusted-ca-file", tlsFiles.CAFile, "--client-cert-auth")
	}
	if opts.MaxTxnOps > 0 {
		args = append(args, "--max-txn-ops", strconv.FormatUint(uint64(opts.MaxTxnOps), 10))
	}
	if opts.QuotaBackendBytes > 0 {
		args = append(args, "--quota-backend-bytes", strconv.FormatInt(opts.QuotaBackendBytes, 10))
	}
	logFile, err := os.Create(filepath.Join(dir, "etcd.log"))
	if err != nil {
		return nil, fmt.Errorf("etcdtest: %w", err)
	}
	cmd := exec.Command(bin, args...)
	cmd.Env = processEnv()
	cmd.Stdout, cmd.Stderr = logFile, logFile
	if err := cmd.Start(); err != nil {
		logFile.Close()
		return nil, fmt.Errorf("etcdtest: starting %s: %w", bin, err)
	}
	p := &process{cmd: cmd, done: make(chan struct{})}
	go func() {
		_ = cmd.Wait()
		logFile.Close()
		close(p.done)
	}()
	srv := &Server{proc: p, Endpoint: clientURL.String(), TLS: tlsFiles}
	if err := srv.waitReady(p.done); err != nil {
		p.close()
		log, _ := os.ReadFile(logFile.Name())
		return nil, fmt.Errorf("etcdtest: member process: %w\n%s", err, log)
	}
	return srv, nil
}

// waitReady polls the member until a read succeeds, it exits, or startTimeout passes.
func (s *Server) waitReady(exited <-chan struct{}) error {
	cli, err := s.NewClient()
	if err != nil {
		return err
	}
	defer cli.Close()
	deadline := time.Now().Add(startTimeout)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err = cli.Get(ctx, "health")
		cancel()
		if err == nil {
			return nil
		}
		select {
		case <-exited:
			return errors.New("the process exited before it was ready")
		default:
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("not ready after %s: %w", startTimeout, err)
		}
		time.Sleep(50 * time.Millisecond)
	}
}
