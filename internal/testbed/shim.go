package testbed

import (
	"bytes"
	"context"
	"crypto/sha256"
	"crypto/tls"
	"crypto/x509"
	"encoding/hex"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"k8s.io/client-go/rest"
)

// ShimConfig configures a shim process.
type ShimConfig struct {
	// Name names the process and its log file (default "shim").
	Name string
	// Dir holds the shim's certificates, token file, kubeconfig and embedded etcd data.
	Dir string
	// EncryptionConfig is passed as --encryption-provider-config when set.
	EncryptionConfig string
	// EtcdServers are external etcd URLs (all members of a cluster, comma separated on
	// the command line); empty runs the embedded etcd.
	EtcdServers []string
	// EtcdPrefix is --etcd-prefix (default /registry).
	EtcdPrefix string
	// Layer is --encryption-layer (default rekey).
	Layer string
	// APIServerID is passed as --apiserver-id when set (the member name in a cluster).
	APIServerID string
	// Args are appended to the command line as they are, so flags the testbed does
	// not model (the cluster coordination flags, for instance) pass through.
	Args []string
	// Env are environment entries added to RunEnv's (a later entry of a name wins):
	// GODEBUG=fips140=on runs a default build in FIPS mode.
	Env []string
}

// Shim is a running shim process.
type Shim struct {
	*Process
	URL        string
	Port       int
	CAFile     string
	Token      string
	Kubeconfig string
	// Ready is the time from start to the first successful /readyz (set by
	// WaitReady).
	Ready time.Duration

	started time.Time
	probe   *http.Client // unauthenticated, for /readyz
}

// ShimArgs returns the command line StartShim uses, with its token file written.
func ShimArgs(c ShimConfig) ([]string, error) {
	if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return nil, err
	}
	tokens := filepath.Join(c.Dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(adminToken+",admin,admin-uid,\"system:masters\"\n"), 0o600); err != nil {
		return nil, err
	}
	args := []string{
		"--secure-port", "0", "--port-file", filepath.Join(c.Dir, "port"),
		"--cert-dir", filepath.Join(c.Dir, "certs"),
		"--token-auth-file", tokens,
		"--data-dir", filepath.Join(c.Dir, "etcd"),
		"--etcd-unsafe-no-fsync",
	}
	if c.APIServerID != "" {
		args = append(args, "--apiserver-id", c.APIServerID)
	}
	if c.EncryptionConfig != "" {
		args = append(args, "--encryption-provider-config", c.EncryptionConfig)
	}
	if len(c.EtcdServers) > 0 {
		args = append(args, "--etcd-servers", strings.Join(c.EtcdServers, ","))
	}
	if c.EtcdPrefix != "" {
		args = append(args, "--etcd-prefix", c.EtcdPrefix)
	}
	if c.Layer != "" {
		args = append(args, "--encryption-layer", c.Layer)
	}
	// Every shim of a test run shares the host (and so the default apiserver identity)
	// and often one etcd: its applied encryption state must not be another shim's. The
	// id follows Dir, so a restart on the same Dir finds its own state.
	sum := sha256.Sum256([]byte(c.Dir))
	args = append(args, "--encryption-state-id", "testbed-"+hex.EncodeToString(sum[:8]))
	return append(args, c.Args...), nil
}

const adminToken = "testbed-admin-token"

// StartShim starts the shim and waits until /readyz answers 200.
func StartShim(ctx context.Context, bin string, c ShimConfig) (*Shim, error) {
	s, err := LaunchShim(ctx, bin, c)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	if err := s.WaitReady(ctx); err != nil {
		s.Kill()
		return nil, err
	}
	return s, nil
}

// LaunchShim starts the shim and waits until it listens, not until it is ready: a
// shim that must stay unready (a straggler) can be watched with Readyz.
func LaunchShim(ctx context.Context, bin string, c ShimConfig) (*Shim, error) {
	if c.Name == "" {
		c.Name = "shim"
	}
	args, err := ShimArgs(c)
	if err != nil {
		return nil, err
	}
	portFile := filepath.Join(c.Dir, "port")
	_ = os.Remove(portFile)
	start := time.Now()
	p, err := StartEnv(c.Name, c.Dir, bin, append(RunEnv(), c.Env...), args...)
	if err != nil {
		return nil, err
	}
	s := &Shim{Process: p, Token: adminToken, CAFile: filepath.Join(c.Dir, "certs", "apiserver.crt"), started: start}
	ctx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	err = poll(ctx, p, 10*time.Millisecond, func() error {
		b, err := os.ReadFile(portFile)
		if err != nil {
			return err
		}
		s.Port, err = strconv.Atoi(strings.TrimSpace(string(b)))
		return err
	})
	if err != nil {
		p.Kill()
		return nil, fmt.Errorf("%s did not listen: %w", c.Name, err)
	}
	s.URL = "https://127.0.0.1:" + strconv.Itoa(s.Port)
	if s.probe, err = s.HTTPClient(false); err != nil {
		p.Kill()
		return nil, err
	}
	s.Kubeconfig = filepath.Join(c.Dir, "kubeconfig")
	if err := os.WriteFile(s.Kubeconfig, []byte(Kubeconfig(s.URL, s.CAFile, s.Token)), 0o600); err != nil {
		p.Kill()
		return nil, err
	}
	return s, nil
}

// Readyz returns nil when /readyz answers 200, or an error with the failing checks.
func (s *Shim) Readyz(ctx context.Context) error {
	req, err := http.NewRequestWithContext(ctx, http.MethodGet, s.URL+"/readyz?verbose", nil)
	if err != nil {
		return err
	}
	resp, err := s.probe.Do(req)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		body, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return fmt.Errorf("/readyz: %d: %s", resp.StatusCode, failedChecks(string(body)))
	}
	return nil
}

// failedChecks keeps the failing lines of a verbose /readyz body.
func failedChecks(body string) string {
	var out []string
	for _, l := range strings.Split(body, "\n") {
		if strings.Contains(l, "[-]") {
			out = append(out, strings.TrimSpace(l))
		}
	}
	if len(out) == 0 {
		return strings.TrimSpace(body)
	}
	return strings.Join(out, "; ")
}

// WaitReady polls /readyz until it answers 200, ctx ends or the process exits, and
// sets Ready on the first success.
func (s *Shim) WaitReady(ctx context.Context) error {
	err := poll(ctx, s.Process, 10*time.Millisecond, func() error { return s.Readyz(ctx) })
	if err != nil {
		return fmt.Errorf("%s not ready: %w", s.Name, err)
	}
	if s.Ready == 0 {
		s.Ready = time.Since(s.started)
	}
	return nil
}

// Kubeconfig renders a kubeconfig for one server and token.
func Kubeconfig(url, caFile, token string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Config
clusters:
- name: shim
  cluster: {server: %q, certificate-authority: %q}
users:
- name: admin
  user: {token: %q}
contexts:
- name: shim
  context: {cluster: shim, user: admin}
current-context: shim
`, url, caFile, token)
}

// RESTConfig is a client-go config authenticated as the admin user.
func (s *Shim) RESTConfig() *rest.Config {
	return &rest.Config{Host: s.URL, BearerToken: s.Token,
		TLSClientConfig: rest.TLSClientConfig{CAFile: s.CAFile}, QPS: -1}
}

// HTTPClient returns a client that trusts the shim's certificate, sending the admin
// token when authenticated is true.
func (s *Shim) HTTPClient(authenticated bool) (*http.Client, error) {
	pem, err := os.ReadFile(s.CAFile)
	if err != nil {
		return nil, err
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("no certificate in %s", s.CAFile)
	}
	var rt http.RoundTripper = &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool}}
	if authenticated {
		rt = bearer{token: s.Token, next: rt}
	}
	return &http.Client{Transport: rt, Timeout: 30 * time.Second}, nil
}

type bearer struct {
	token string
	next  http.RoundTripper
}

func (b bearer) RoundTrip(r *http.Request) (*http.Response, error) {
	r = r.Clone(r.Context())
	r.Header.Set("Authorization", "Bearer "+b.token)
	return b.next.RoundTrip(r)
}

// KubectlPath is the kubectl the e2e tests use: $KUBECTL when set, else the first
// kubectl on PATH (.ci/run puts one built from k8s.io/kubernetes there when the machine
// has none), else /usr/bin/kubectl.
func KubectlPath() string {
	if p := os.Getenv("KUBECTL"); p != "" {
		return p
	}
	if p, err := exec.LookPath("kubectl"); err == nil {
		return p
	}
	return "/usr/bin/kubectl"
}

// Kubectl runs kubectl against the shim and returns its stdout; stdin is optional.
func (s *Shim) Kubectl(ctx context.Context, stdin string, args ...string) (string, error) {
	cmd := exec.CommandContext(ctx, KubectlPath(), append([]string{"--kubeconfig", s.Kubeconfig}, args...)...)
	if stdin != "" {
		cmd.Stdin = strings.NewReader(stdin)
	}
	var out, errb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &errb
	if err := cmd.Run(); err != nil {
		return out.String(), fmt.Errorf("kubectl %s: %w: %s", strings.Join(args, " "), err, errb.String())
	}
	return out.String(), nil
}
