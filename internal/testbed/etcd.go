package testbed

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
)

// Etcd is an etcd server process.
type Etcd struct {
	*Process
	// Endpoint is the client URL.
	Endpoint string
}

// StartEtcd runs a single-member etcd (fsync off) with its data under dir and waits
// until it answers.
func StartEtcd(ctx context.Context, bin, dir string) (*Etcd, error) {
	return StartEtcdWith(ctx, bin, dir)
}

// StartEtcdWith is StartEtcd with extra etcd flags (--quota-backend-bytes, for a run
// that measures the database against its quota).
func StartEtcdWith(ctx context.Context, bin, dir string, extra ...string) (*Etcd, error) {
	data := filepath.Join(dir, "etcd-data")
	return retryLostPort(func() (*Etcd, error) {
		if err := os.RemoveAll(data); err != nil {
			return nil, err
		}
		return startEtcd(ctx, bin, dir, data, extra)
	})
}

func startEtcd(ctx context.Context, bin, dir, data string, extra []string) (*Etcd, error) {
	if err := os.MkdirAll(data, 0o700); err != nil {
		return nil, err
	}
	cport, err := FreePort()
	if err != nil {
		return nil, err
	}
	pport, err := FreePort()
	if err != nil {
		return nil, err
	}
	client := "http://127.0.0.1:" + strconv.Itoa(cport)
	peer := "http://127.0.0.1:" + strconv.Itoa(pport)
	args := append([]string{"--name", "testbed", "--data-dir", data,
		"--listen-client-urls", client, "--advertise-client-urls", client,
		"--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
		"--initial-cluster", "testbed=" + peer,
		"--unsafe-no-fsync", "--log-level", "warn"}, extra...)
	// etcd runs outside FIPS mode (fixtureRunEnv): it computes member ids with SHA-1.
	p, err := StartEnv("etcd", dir, bin, fixtureRunEnv(), args...)
	if err != nil {
		return nil, err
	}
	e := &Etcd{Process: p, Endpoint: client}
	cli, err := EtcdClient([]string{client})
	if err != nil {
		p.Kill()
		return nil, err
	}
	defer cli.Close()
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	err = poll(ctx, p, 50*time.Millisecond, func() error {
		c, cancel := context.WithTimeout(ctx, time.Second)
		defer cancel()
		_, err := cli.Get(c, "health")
		return err
	})
	if err != nil {
		p.Kill()
		return nil, fmt.Errorf("etcd not ready: %w", err)
	}
	return e, nil
}
