package layer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
)

// DefaultEtcdDialTimeout bounds the first connection of the layer's etcd clients.
const DefaultEtcdDialTimeout = 10 * time.Second

// Etcd is where and how the layer's own etcd clients connect: the apiserver's storage
// backend flags (--etcd-servers, --etcd-cafile, --etcd-certfile, --etcd-keyfile), so
// that the cluster node, the migration controller and the applied-state check reach
// etcd exactly as the storage backend does.
type Etcd struct {
	Servers  []string
	CAFile   string
	CertFile string
	KeyFile  string
}

// HasTLS reports whether any TLS file is set; with none the clients dial plaintext, as
// the storage backend does.
func (e Etcd) HasTLS() bool { return e.CAFile != "" || e.CertFile != "" || e.KeyFile != "" }

// ClientConfig is the clientv3 configuration for e with timeout as dial timeout.
func (e Etcd) ClientConfig(timeout time.Duration) (clientv3.Config, error) {
	cfg := clientv3.Config{Endpoints: e.Servers, DialTimeout: timeout, Logger: zap.NewNop()}
	if e.HasTLS() {
		info := transport.TLSInfo{TrustedCAFile: e.CAFile, CertFile: e.CertFile, KeyFile: e.KeyFile}
		tc, err := info.ClientConfig()
		if err != nil {
			return cfg, fmt.Errorf("etcd TLS from --etcd-cafile, --etcd-certfile, --etcd-keyfile: %w", err)
		}
		cfg.TLS = tc
	}
	return cfg, nil
}

// NewClient is the one place the layer's etcd clients are configured.
func (e Etcd) NewClient() (*clientv3.Client, error) {
	cfg, err := e.ClientConfig(DefaultEtcdDialTimeout)
	if err != nil {
		return nil, err
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("etcd client for %s: %w", strings.Join(e.Servers, ","), err)
	}
	return cli, nil
}

// Check fails with a clear error when none of the servers answers within timeout, so a
// wrong --etcd-servers or TLS file is reported at start instead of as hanging requests.
// hint says what to check when no TLS file is set.
func (e Etcd) Check(ctx context.Context, timeout time.Duration, hint string) error {
	if e.HasTLS() {
		hint = "check --etcd-servers and the TLS files --etcd-cafile, --etcd-certfile, --etcd-keyfile"
	}
	cfg, err := e.ClientConfig(timeout)
	if err != nil {
		return err
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return fmt.Errorf("cannot reach etcd at %s: %w (%s)", strings.Join(e.Servers, ","), err, hint)
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	if _, err := cli.Get(ctx, "health"); err != nil {
		if errors.Is(err, context.DeadlineExceeded) {
			err = fmt.Errorf("no answer within %s", timeout)
		}
		return fmt.Errorf("cannot reach etcd at %s: %w (%s)", strings.Join(e.Servers, ","), err, hint)
	}
	return nil
}
