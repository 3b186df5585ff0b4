package shim

import (
	"context"
	"crypto/fips140"
	"errors"
	"fmt"
	"net"
	"net/url"
	"os"
	"strconv"
	"strings"
	"time"

	"go.etcd.io/etcd/server/v3/embed"

	"github.com/rekey-io/rekey/internal/freeport"
	"github.com/rekey-io/rekey/pkg/layer"
)

// embeddedEtcd is a single-member etcd running inside the shim's process.
type embeddedEtcd struct {
	etcd      *embed.Etcd
	endpoints []string
}

// startEmbeddedEtcd starts etcd with its data in dir on two free loopback ports and
// waits until it serves.
func startEmbeddedEtcd(ctx context.Context, dir string, noFsync bool, logLevel string) (*embeddedEtcd, error) {
	if fips140.Enforced() {
		// etcd computes its member ids with SHA-1 (membership.computeMemberID), which
		// Go refuses under fips140=only with a panic: say so before starting it.
		return nil, errors.New("embedded etcd cannot run in FIPS 140-3 mode enforced (GODEBUG=fips140=only): etcd computes member ids with SHA-1, which Go refuses in that mode; " +
			"run etcd as its own process and pass --etcd-servers, or run with GODEBUG=fips140=on")
	}
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

// freePorts returns n distinct loopback ports that were free a moment ago, below the
// ephemeral range (internal/freeport says why).
func freePorts(n int) ([]int, error) { return freeport.PickN(n) }

// checkEtcd fails with a clear error when none of the servers answers within timeout,
// so a wrong --etcd-servers or TLS file is reported at start instead of as hanging
// requests.
func checkEtcd(ctx context.Context, e layer.Etcd, timeout time.Duration) error {
	return e.Check(ctx, timeout, "check --etcd-servers, or leave it empty to run an embedded etcd")
}
