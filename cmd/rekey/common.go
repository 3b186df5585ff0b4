package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// common are the flags every command shares; names are kube-apiserver's.
type common struct {
	// etcd is how to reach etcd, configured as the encryption layer's own clients are.
	etcd       layer.Etcd
	etcdPrefix string
	configPath string
	resources  []string
	pageSize   int64
	kmsWait    time.Duration
	timeout    time.Duration
	// acknowledgedUnder is the coordination prefix whose acknowledged unreadable objects
	// an inventory counts apart ("" counts none).
	acknowledgedUnder string
}

// addEtcdFlags adds how to reach etcd: the flags every command has, with
// kube-apiserver's names, so an apiserver's etcd flags can be copied as they are.
func (c *common) addEtcdFlags(fs *pflag.FlagSet) {
	fs.StringSliceVar(&c.etcd.Servers, "etcd-servers", nil, "etcd servers to connect to (scheme://ip:port), comma separated. Required.")
	fs.StringVar(&c.etcd.CAFile, "etcd-cafile", "", "SSL Certificate Authority file used to secure etcd communication.")
	fs.StringVar(&c.etcd.CertFile, "etcd-certfile", "", "SSL certification file used to secure etcd communication.")
	fs.StringVar(&c.etcd.KeyFile, "etcd-keyfile", "", "SSL key file used to secure etcd communication.")
	fs.DurationVar(&c.timeout, "etcd-dial-timeout", 10*time.Second, "How long to wait for etcd to answer.")
}

// addEtcdPrefixFlag adds --etcd-prefix, which also gives --coordination-prefix its
// default (coordinationPrefix).
func (c *common) addEtcdPrefixFlag(fs *pflag.FlagSet) {
	fs.StringVar(&c.etcdPrefix, "etcd-prefix", migrate.DefaultEtcdPrefix, "The prefix of all resource paths in etcd (kube-apiserver's --etcd-prefix).")
}

// coordinationPrefix is --coordination-prefix (flag), or the apiservers' default for
// --etcd-prefix when it is not set.
func (c *common) coordinationPrefix(flag string) string {
	if flag != "" {
		return flag
	}
	return layer.DefaultCoordinationPrefix(c.etcdPrefix)
}

func (c *common) addFlags(fs *pflag.FlagSet) {
	c.addEtcdFlags(fs)
	c.addEtcdPrefixFlag(fs)
	fs.StringVar(&c.configPath, "encryption-provider-config", "", "The EncryptionConfiguration the apiservers run now. Required.")
	fs.StringSliceVar(&c.resources, "resources", nil, "Resources to scan: secrets, widgets.example.com, or deployments.apps=/registry/deployments/ for a custom etcd path. Default: every resource the configuration names explicitly (secrets and configmaps when it only has wildcards).")
	fs.Int64Var(&c.pageSize, "page-size", migrate.DefaultPageSize, "Objects per etcd range request.")
	fs.DurationVar(&c.kmsWait, "kms-wait", 15*time.Second, "How long to wait for KMS v2 plugins to report their current key id.")
}

// validate checks the flags every command that reads stored data needs.
func (c *common) validate() error {
	if err := c.validateEtcd(); err != nil {
		return err
	}
	if c.configPath == "" {
		return errors.New("--encryption-provider-config is required: the keys that read the stored data are in it")
	}
	return nil
}

func (c *common) validateEtcd() error {
	if len(c.etcd.Servers) == 0 {
		return errors.New("--etcd-servers is required")
	}
	return nil
}

// client is the one etcd client of the commands: the layer's client configuration
// (TLS from the --etcd-* files) with room for large pages, checked to answer.
func (c *common) client(ctx context.Context) (*clientv3.Client, error) {
	cfg, err := c.etcd.ClientConfig(c.timeout)
	if err != nil {
		return nil, err
	}
	// A page stops at about migrate.DefaultPageBytes (and is asked again smaller if an
	// answer is still too large), so 64 MiB leaves room for pages of the largest values
	// etcd accepts. Set in Config: the client's own per-call default (2 GiB) would
	// override a dial option.
	cfg.MaxCallRecvMsgSize = 64 << 20
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %v: %w", c.etcd.Servers, err)
	}
	sctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	if _, err := cli.Status(sctx, c.etcd.Servers[0]); err != nil {
		_ = cli.Close()
		return nil, fmt.Errorf("etcd %s does not answer (%v); check --etcd-servers and the TLS flags", c.etcd.Servers[0], err)
	}
	return cli, nil
}

// session is what a command works with once the preamble shared by every command ran:
// flags checked, etcd reached, and for the commands that read stored data the
// configuration read, checked and built.
type session struct {
	log  klog.Logger
	etcd *clientv3.Client
	// cur is --encryption-provider-config (or the configuration the caller passed)
	// with its transformers; nil for a command that reads no stored data.
	cur *loaded
}

// preamble says what a command needs from open.
type preamble struct {
	// config: read and check --encryption-provider-config and build its transformers.
	config bool
	// cfg: build this configuration, already read and checked by the caller, instead.
	cfg *config.Config
	// requireKMS: a KMS plugin that is not ready is an error (the command writes).
	requireKMS bool
}

// open runs the preamble; the caller closes the session.
func (c *common) open(ctx context.Context, p preamble) (*session, error) {
	check := c.validateEtcd
	if p.config {
		check = c.validate
	}
	if err := check(); err != nil {
		return nil, err
	}
	s := &session{log: klog.Background()}
	cli, err := c.client(ctx)
	if err != nil {
		return nil, err
	}
	s.etcd = cli
	switch {
	case p.cfg != nil:
		s.cur, err = c.build(ctx, p.cfg, p.requireKMS)
	case p.config:
		s.cur, err = c.load(ctx, c.configPath, p.requireKMS)
	}
	if err != nil {
		_ = cli.Close()
		return nil, err
	}
	return s, nil
}

// Close releases the session's transformers and etcd client.
func (s *session) Close() {
	if s.cur != nil {
		s.cur.set.Close()
	}
	_ = s.etcd.Close()
}

// loaded is a configuration with its built transformers.
type loaded struct {
	cfg *config.Config
	set *transformers.Set
}

// load reads and builds a configuration; KMS v2 providers connect to their plugins,
// and are waited for up to --kms-wait. requireKMS makes a plugin that is not ready
// an error (a migration must write).
func (c *common) load(ctx context.Context, path string, requireKMS bool) (*loaded, error) {
	cfg, err := config.Load(path, config.Options{Reload: true})
	if err != nil {
		return nil, err
	}
	return c.build(ctx, cfg, requireKMS)
}

// build is load for a configuration already read (and checked) by the caller.
func (c *common) build(ctx context.Context, cfg *config.Config, requireKMS bool) (*loaded, error) {
	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{}), Logger: klog.Background()})
	if err != nil {
		return nil, err
	}
	for _, k := range set.KMSProviders() {
		wctx, cancel := context.WithTimeout(ctx, c.kmsWait)
		err := k.WaitReady(wctx)
		cancel()
		if err != nil {
			if requireKMS {
				set.Close()
				return nil, fmt.Errorf("kms provider %q (%s) is not ready after %s: %w; the migration needs it to write", k.Name(), k.Status().Endpoint, c.kmsWait, err)
			}
			klog.InfoS("KMS provider not ready; its values are classified by provider name only, not key id", "provider", k.Name(), "err", err)
		}
	}
	return &loaded{cfg: cfg, set: set}, nil
}

// inventory takes a fresh inventory of the resources cfgs name (resourceList), reading
// the stored objects with l's transformers and recording l's configuration hash.
func (c *common) inventory(ctx context.Context, cli *clientv3.Client, l *loaded, decryptCheck bool, cfgs ...*config.Config) (*migrate.Inventory, []migrate.Resource, error) {
	res, err := c.resourceList(cfgs...)
	if err != nil {
		return nil, nil, err
	}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{
		Client: cli, Source: migrate.FromSet(l.set), Resources: res, PageSize: c.pageSize,
		DecryptCheck: decryptCheck, ConfigHash: l.cfg.Hash, CoordinationPrefix: c.acknowledgedUnder,
	})
	return inv, res, err
}

// resourceList resolves --resources, defaulting to the explicit rules of cfgs (all of
// them: check-config also scans what only the new configuration names).
func (c *common) resourceList(cfgs ...*config.Config) ([]migrate.Resource, error) {
	names := c.resources
	if len(names) == 0 {
		seen := map[string]bool{}
		var entries []transformers.Entry[transformers.ConfigKey]
		for _, cfg := range cfgs {
			entries = append(entries, transformers.Describe(cfg)...)
		}
		for _, e := range entries {
			for _, r := range e.Resources {
				gr := schema.ParseGroupResource(r)
				if strings.Contains(r, "*") || seen[gr.String()] {
					continue
				}
				seen[gr.String()] = true
				names = append(names, gr.String())
			}
		}
		if len(names) == 0 {
			names = []string{"secrets", "configmaps"}
		}
	}
	var out []migrate.Resource
	for _, n := range names {
		r, err := migrate.ParseResource(c.etcdPrefix, n)
		if err != nil {
			return nil, fmt.Errorf("--resources: %w", err)
		}
		out = append(out, r)
	}
	return out, nil
}
