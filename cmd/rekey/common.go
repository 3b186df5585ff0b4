package main

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"time"

	"github.com/spf13/pflag"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// common are the flags every command shares; names are kube-apiserver's.
type common struct {
	etcdServers []string
	etcdPrefix  string
	etcdCA      string
	etcdCert    string
	etcdKey     string
	configPath  string
	resources   []string
	pageSize    int64
	kmsWait     time.Duration
	timeout     time.Duration
}

// addEtcdFlags adds how to reach etcd: the flags every command has, with
// kube-apiserver's names, so an apiserver's etcd flags can be copied as they are.
func (c *common) addEtcdFlags(fs *pflag.FlagSet) {
	fs.StringSliceVar(&c.etcdServers, "etcd-servers", nil, "etcd servers to connect to (scheme://ip:port), comma separated. Required.")
	fs.StringVar(&c.etcdCA, "etcd-cafile", "", "SSL Certificate Authority file used to secure etcd communication.")
	fs.StringVar(&c.etcdCert, "etcd-certfile", "", "SSL certification file used to secure etcd communication.")
	fs.StringVar(&c.etcdKey, "etcd-keyfile", "", "SSL key file used to secure etcd communication.")
	fs.DurationVar(&c.timeout, "etcd-dial-timeout", 10*time.Second, "How long to wait for etcd to answer.")
}

func (c *common) addFlags(fs *pflag.FlagSet) {
	c.addEtcdFlags(fs)
	fs.StringVar(&c.etcdPrefix, "etcd-prefix", migrate.DefaultEtcdPrefix, "The prefix of all resource paths in etcd (kube-apiserver's --etcd-prefix).")
	fs.StringVar(&c.configPath, "encryption-provider-config", "", "The EncryptionConfiguration the apiservers run now. Required.")
	fs.StringSliceVar(&c.resources, "resources", nil, "Resources to scan: secrets, widgets.example.com, or deployments.apps=/registry/deployments/ for a custom etcd path. Default: every resource the configuration names explicitly (secrets and configmaps when it only has wildcards).")
	fs.Int64Var(&c.pageSize, "page-size", migrate.DefaultPageSize, "Objects per etcd range request.")
	fs.DurationVar(&c.kmsWait, "kms-wait", 15*time.Second, "How long to wait for KMS v2 plugins to report their current key id.")
}

func (c *common) validate() error {
	if len(c.etcdServers) == 0 {
		return errors.New("--etcd-servers is required")
	}
	if c.configPath == "" {
		return errors.New("--encryption-provider-config is required: the keys that read the stored data are in it")
	}
	return nil
}

func (c *common) client(ctx context.Context) (*clientv3.Client, error) {
	cfg := clientv3.Config{
		Endpoints:   c.etcdServers,
		DialTimeout: c.timeout,
		Logger:      zap.NewNop(),
		// A page stops at about migrate.DefaultPageBytes (and is asked again smaller if
		// an answer is still too large), so 64 MiB leaves room for pages of the largest
		// values etcd accepts. Set in Config: the client's own per-call default
		// (2 GiB) would override a dial option.
		MaxCallRecvMsgSize: 64 << 20,
	}
	if c.etcdCert != "" || c.etcdKey != "" || c.etcdCA != "" {
		tlsInfo := transport.TLSInfo{CertFile: c.etcdCert, KeyFile: c.etcdKey, TrustedCAFile: c.etcdCA}
		tc, err := tlsInfo.ClientConfig()
		if err != nil {
			return nil, fmt.Errorf("etcd TLS files: %w", err)
		}
		cfg.TLS = tc
	}
	cli, err := clientv3.New(cfg)
	if err != nil {
		return nil, fmt.Errorf("connecting to etcd %v: %w", c.etcdServers, err)
	}
	sctx, cancel := context.WithTimeout(ctx, c.timeout)
	defer cancel()
	if _, err := cli.Status(sctx, c.etcdServers[0]); err != nil {
		_ = cli.Close()
		return nil, fmt.Errorf("etcd %s does not answer (%v); check --etcd-servers and the TLS flags", c.etcdServers[0], err)
	}
	return cli, nil
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
		DecryptCheck: decryptCheck, ConfigHash: l.cfg.Hash,
	})
	return inv, res, err
}

// resourceList resolves --resources, defaulting to the explicit rules of cfgs (all of
// them: check-config also scans what only the new configuration names).
func (c *common) resourceList(cfgs ...*config.Config) ([]migrate.Resource, error) {
	names := c.resources
	if len(names) == 0 {
		seen := map[string]bool{}
		for _, rc := range allRules(cfgs) {
			for _, r := range rc.Resources {
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

func allRules(cfgs []*config.Config) []apiserver.ResourceConfiguration {
	var out []apiserver.ResourceConfiguration
	for _, cfg := range cfgs {
		out = append(out, cfg.Encryption.Resources...)
	}
	return out
}
