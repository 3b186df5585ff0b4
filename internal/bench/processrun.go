package bench

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/testbed"
)

// processRun is what a scenario of processes (etcd, shims) starts with: a context an
// interrupt cancels, so an interrupted run stops its processes (their own process
// groups do not get the terminal's signal); a scratch directory; the progress writer;
// and the testbed's binaries, built into the directory.
type processRun struct {
	ctx      context.Context
	dir      string
	progress io.Writer
	bins     testbed.Binaries
	stop     context.CancelFunc
}

// startProcessRun builds the testbed's binaries into a new scratch directory named
// after tmpPrefix; building is announced on the progress writer as announce (unless
// empty).
func startProcessRun(s Settings, tmpPrefix, announce string) (r *processRun, err error) {
	r = &processRun{progress: s.Progress}
	if r.progress == nil {
		r.progress = io.Discard
	}
	r.ctx, r.stop = signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	if r.dir, err = os.MkdirTemp("", tmpPrefix); err != nil {
		r.stop()
		return nil, err
	}
	if announce != "" {
		fmt.Fprintln(r.progress, announce)
	}
	if r.bins, err = testbed.Build(r.ctx, filepath.Join(r.dir, "bin")); err != nil {
		r.close()
		return nil, err
	}
	return r, nil
}

// close removes the scratch directory and stops listening for interrupts.
func (r *processRun) close() {
	os.RemoveAll(r.dir)
	r.stop()
}

// bed is the set-up the scenarios of processes share: a processRun and, as asked, an
// etcd process (and a client), and a KMS v2 plugin process with an encryption
// configuration that encrypts Secrets with it (kmsThenIdentityConfig).
type bed struct {
	*processRun
	etcd *testbed.Etcd
	cli  *clientv3.Client
	// plugin and configPath, with bedOptions.plugin.
	plugin     *testbed.Plugin
	configPath string
}

// bedOptions say what startBed starts besides the build: etcd (with a client to it
// when client is set too) and the plugin.
type bedOptions struct {
	etcd, client, plugin bool
}

// startBed starts a processRun (tmpPrefix, announce: see startProcessRun), then what o
// asks for, in the scratch directory; close stops them in reverse.
func startBed(s Settings, tmpPrefix, announce string, o bedOptions) (b *bed, err error) {
	run, err := startProcessRun(s, tmpPrefix, announce)
	if err != nil {
		return nil, err
	}
	b = &bed{processRun: run}
	defer func() {
		if err != nil {
			b.close()
		}
	}()
	if o.etcd {
		if b.etcd, err = testbed.StartEtcd(b.ctx, b.bins.Etcd, b.dir); err != nil {
			return nil, err
		}
	}
	if o.etcd && o.client {
		if b.cli, err = testbed.EtcdClient([]string{b.etcd.Endpoint}); err != nil {
			return nil, err
		}
	}
	if o.plugin {
		if b.plugin, err = testbed.StartPlugin(b.ctx, b.bins.Plugin, b.dir, b.dir, testbed.PluginKey{Name: "bench-key", Secret: testbed.RandomKey()}); err != nil {
			return nil, err
		}
		b.configPath = filepath.Join(b.dir, "encryption.yaml")
		if err := os.WriteFile(b.configPath, []byte(kmsThenIdentityConfig(b.plugin.Endpoint)), 0o600); err != nil {
			return nil, err
		}
	}
	return b, nil
}

// close stops the plugin, the client and etcd, and removes the scratch directory.
func (b *bed) close() {
	if b.plugin != nil {
		b.plugin.Stop(5 * time.Second)
	}
	if b.cli != nil {
		b.cli.Close()
	}
	if b.etcd != nil {
		b.etcd.Stop(10 * time.Second)
	}
	b.processRun.close()
}
