// Package etcdtest starts a real, embedded etcd server (go.etcd.io/etcd/server/v3/embed)
// for tests and benchmarks (under GODEBUG=fips140=only, where etcd cannot run in the
// test's process, a child process of the same etcd): one member on free 127.0.0.1 ports in a temporary
// directory, fsync off, logs quiet. It is real etcd — transactions, revisions,
// compaction and leases behave as in production — not a mock.
//
//	srv := etcdtest.Start(t)
//	cli := srv.Client(t)
//	_, err := cli.Put(ctx, "/registry/secrets/default/s1", "v")
package etcdtest

import (
	"context"
	"crypto/fips140"
	"fmt"
	"net"
	"net/url"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
	"google.golang.org/grpc"

	"github.com/rekey-io/rekey/internal/freeport"
)

// startTimeout bounds how long the member may take to elect itself.
const startTimeout = 30 * time.Second

// Server is a running etcd member: embedded, or a child process under
// GODEBUG=fips140=only (see process.go).
type Server struct {
	etcd *embed.Etcd
	proc *process
	// Endpoint is the client URL, e.g. "http://127.0.0.1:40123" ("https://" with TLS).
	Endpoint string
	// TLS holds the CA and certificate files when the member serves TLS (Options.TLS),
	// else nil.
	TLS *TLSFiles
}

// Options tune the member. The zero value is what most tests want.
type Options struct {
	// MaxTxnOps raises etcd's per-transaction operation limit (default 128).
	MaxTxnOps uint
	// QuotaBackendBytes raises the backend size limit (default 2 GiB).
	QuotaBackendBytes int64
	// TLS serves clients over TLS and requires a client certificate signed by the
	// member's CA (etcd's --client-cert-auth); the generated files are in Server.TLS.
	TLS bool
}

// Start starts a member and stops it when the test ends.
func Start(tb testing.TB) *Server { return StartWith(tb, Options{}) }

// StartWith starts a member with opts and stops it when the test ends.
func StartWith(tb testing.TB, opts Options) *Server {
	tb.Helper()
	var lastErr error
	// Free ports are picked by binding and releasing them; another process can take
	// one in between, so a failed start is retried with new ports.
	for attempt := 0; attempt < 3; attempt++ {
		srv, err := start(tb.TempDir(), opts)
		if err == nil {
			tb.Cleanup(srv.Close)
			return srv
		}
		lastErr = err
	}
	tb.Fatalf("etcdtest: starting embedded etcd failed three times: %v", lastErr)
	return nil
}

// New starts a member with its data in dir, for a TestMain (which has no testing.TB);
// the caller closes it.
func New(dir string, opts Options) (*Server, error) {
	var err error
	for attempt := 0; attempt < 3; attempt++ {
		var srv *Server
		d := filepath.Join(dir, "attempt-"+strconv.Itoa(attempt))
		if err = os.MkdirAll(d, 0o700); err != nil {
			return nil, fmt.Errorf("etcdtest: %w", err)
		}
		if srv, err = start(d, opts); err == nil {
			return srv, nil
		}
	}
	return nil, fmt.Errorf("etcdtest: starting etcd failed three times: %w", err)
}

func start(dir string, opts Options) (*Server, error) {
	clientURL, err := freeURL()
	if err != nil {
		return nil, err
	}
	var tlsFiles *TLSFiles
	if opts.TLS {
		certDir := filepath.Join(dir, "pki")
		if err := os.MkdirAll(certDir, 0o700); err != nil {
			return nil, fmt.Errorf("etcdtest: %w", err)
		}
		if tlsFiles, err = writeTLSFiles(certDir); err != nil {
			return nil, err
		}
		clientURL.Scheme = "https"
	}
	peerURL, err := freeURL()
	if err != nil {
		return nil, err
	}
	if fips140.Enforced() {
		return startProcess(dir, opts, clientURL, peerURL, tlsFiles)
	}
	cfg := embed.NewConfig()
	cfg.Name = "etcdtest"
	cfg.Dir = dir
	cfg.UnsafeNoFsync = true
	cfg.Logger = "zap"
	// Closing a member logs harmless "use of closed network connection" errors; start
	// failures are returned as errors anyway.
	cfg.LogLevel = "fatal"
	cfg.ListenClientUrls = []url.URL{*clientURL}
	cfg.AdvertiseClientUrls = []url.URL{*clientURL}
	cfg.ListenPeerUrls = []url.URL{*peerURL}
	cfg.AdvertisePeerUrls = []url.URL{*peerURL}
	cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)
	if tlsFiles != nil {
		cfg.ClientTLSInfo = transport.TLSInfo{
			CertFile:       tlsFiles.ServerCertFile,
			KeyFile:        tlsFiles.ServerKeyFile,
			TrustedCAFile:  tlsFiles.CAFile,
			ClientCertAuth: true,
		}
	}
	if opts.MaxTxnOps > 0 {
		cfg.MaxTxnOps = opts.MaxTxnOps
	}
	if opts.QuotaBackendBytes > 0 {
		cfg.QuotaBackendBytes = opts.QuotaBackendBytes
	}
	e, err := embed.StartEtcd(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: start: %w", err)
	}
	select {
	case <-e.Server.ReadyNotify():
	case err := <-e.Err():
		e.Close()
		return nil, fmt.Errorf("etcdtest: member failed before it was ready: %w", err)
	case <-time.After(startTimeout):
		e.Server.Stop()
		e.Close()
		return nil, fmt.Errorf("etcdtest: member not ready after %s", startTimeout)
	}
	return &Server{etcd: e, Endpoint: clientURL.String(), TLS: tlsFiles}, nil
}

func freeURL() (*url.URL, error) {
	port, err := freeport.Pick()
	if err != nil {
		return nil, fmt.Errorf("etcdtest: finding a free port: %w", err)
	}
	return &url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(port))}, nil
}

// Client returns a client of the member, closed when the test ends.
func (s *Server) Client(tb testing.TB) *clientv3.Client {
	tb.Helper()
	cli, err := s.NewClient()
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { _ = cli.Close() })
	return cli
}

// NewClient returns a client of the member; the caller closes it.
func (s *Server) NewClient() (*clientv3.Client, error) {
	cfg := clientv3.Config{
		Endpoints:   []string{s.Endpoint},
		DialTimeout: 5 * time.Second,
		Logger:      zap.NewNop(),
		DialOptions: []grpc.DialOption{grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(64 << 20))},
	}
	if s.TLS != nil {
		info := transport.TLSInfo{CertFile: s.TLS.ClientCertFile, KeyFile: s.TLS.ClientKeyFile, TrustedCAFile: s.TLS.CAFile}
		tc, err := info.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("etcdtest: client TLS: %w", err)
		}
		cfg.TLS = tc
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcdtest: client for %s: %w", s.Endpoint, err)
	}
	return cli, nil
}

// Compact compacts the member's history up to rev (physically), as a kube-apiserver
// does every few minutes; reads at an older revision then fail with ErrCompacted.
func (s *Server) Compact(ctx context.Context, cli *clientv3.Client, rev int64) error {
	_, err := cli.Compact(ctx, rev, clientv3.WithCompactPhysical())
	return err
}

// Close stops the member.
func (s *Server) Close() {
	if s.proc != nil {
		s.proc.close()
		return
	}
	s.etcd.Close()
}
