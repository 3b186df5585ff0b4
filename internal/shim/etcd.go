package shim

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.etcd.io/etcd/server/v3/embed"
	"go.uber.org/zap"
)

// embeddedEtcd is a single-member etcd running inside the shim's process.
type embeddedEtcd struct {
	etcd      *embed.Etcd
	endpoints []string
}

// startEmbeddedEtcd starts etcd with its data in dir on two free loopback ports and
// waits until it serves.
func startEmbeddedEtcd(ctx context.Context, dir string, noFsync bool, logLevel string) (*embeddedEtcd, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("embedded etcd: cannot create --data-dir %q: %w", dir, err)
	}
	var lastErr error
	// A free port can be taken between probing and binding; retry with new ones.
	for attempt := 0; attempt < 3; attempt++ {
		ports, err := freePorts(2)
		if err != nil {
			return nil, fmt.Errorf("embedded etcd: %w", err)
		}
		cfg := embed.NewConfig()
		cfg.Name = "rekey-shim"
		cfg.Dir = dir
		cfg.UnsafeNoFsync = noFsync
		cfg.Logger = "zap"
		cfg.LogLevel = logLevel
		cfg.LogOutputs = []string{"stderr"}
		client := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[0]))}
		peer := url.URL{Scheme: "http", Host: net.JoinHostPort("127.0.0.1", strconv.Itoa(ports[1]))}
		cfg.ListenClientUrls, cfg.AdvertiseClientUrls = []url.URL{client}, []url.URL{client}
		cfg.ListenPeerUrls, cfg.AdvertisePeerUrls = []url.URL{peer}, []url.URL{peer}
		cfg.InitialCluster = cfg.InitialClusterFromName(cfg.Name)

		e, err := embed.StartEtcd(cfg)
		if err != nil {
			lastErr = err
			if strings.Contains(err.Error(), "address already in use") {
				continue
			}
			return nil, fmt.Errorf("embedded etcd in %q: %w", dir, err)
		}
		select {
		case <-e.Server.ReadyNotify():
			return &embeddedEtcd{etcd: e, endpoints: []string{client.String()}}, nil
		case err := <-e.Err():
			e.Close()
			return nil, fmt.Errorf("embedded etcd in %q failed while starting: %w", dir, err)
		case <-ctx.Done():
			e.Close()
			return nil, fmt.Errorf("embedded etcd in %q: not ready: %w", dir, ctx.Err())
		}
	}
	return nil, fmt.Errorf("embedded etcd: no free ports after 3 attempts: %w", lastErr)
}

func (e *embeddedEtcd) close() { e.etcd.Close() }

// freePorts returns n distinct loopback ports that were free a moment ago.
func freePorts(n int) ([]int, error) {
	var ports []int
	for range n {
		l, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			return nil, fmt.Errorf("cannot find a free port: %w", err)
		}
		defer l.Close()
		ports = append(ports, l.Addr().(*net.TCPAddr).Port)
	}
	return ports, nil
}

// etcdConn is where and how the shim's own etcd clients connect: the storage backend's
// --etcd-servers and its TLS files (--etcd-cafile, --etcd-certfile, --etcd-keyfile).
type etcdConn struct {
	servers []string
	tls     transport.TLSInfo
}

// hasTLS reports whether any TLS file is set; with none the clients dial plaintext,
// as the storage backend does.
func (e etcdConn) hasTLS() bool {
	return e.tls.TrustedCAFile != "" || e.tls.CertFile != "" || e.tls.KeyFile != ""
}

// clientConfig is the clientv3 configuration for e with timeout as dial timeout.
func (e etcdConn) clientConfig(timeout time.Duration) (clientv3.Config, error) {
	cfg := clientv3.Config{Endpoints: e.servers, DialTimeout: timeout, Logger: zap.NewNop()}
	if e.hasTLS() {
		tc, err := e.tls.ClientConfig()
		if err != nil {
			return cfg, fmt.Errorf("etcd TLS from --etcd-cafile, --etcd-certfile, --etcd-keyfile: %w", err)
		}
		cfg.TLS = tc
	}
	return cfg, nil
}

// checkEtcd fails with a clear error when none of the servers answers within timeout,
// so a wrong --etcd-servers or TLS file is reported at start instead of as hanging
// requests.
func checkEtcd(ctx context.Context, e etcdConn, timeout time.Duration) error {
	hint := "check --etcd-servers, or leave it empty to run an embedded etcd"
	if e.hasTLS() {
		hint = "check --etcd-servers and the TLS files --etcd-cafile, --etcd-certfile, --etcd-keyfile"
	}
	cfg, err := e.clientConfig(timeout)
	if err != nil {
		return err
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return fmt.Errorf("cannot reach etcd at %s: %w (%s)", strings.Join(e.servers, ","), err, hint)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := cli.Get(ctx, "health"); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no answer within %s", timeout)
		}
		return fmt.Errorf("cannot reach etcd at %s: %w (%s)", strings.Join(e.servers, ","), err, hint)
	}
	return nil
}

// newEtcdClient is the one place the shim's etcd clients (storage migration, cluster
// coordination, the applied-state check) are configured from the storage backend's
// flags, so that they all connect as the storage backend does.
func newEtcdClient(e etcdConn) (*clientv3.Client, error) {
	cfg, err := e.clientConfig(DefaultEtcdConnectTimeout)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcd client for %s: %w", strings.Join(e.servers, ","), err)
	}
	return cli, nil
}
