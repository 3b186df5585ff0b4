package main

import (
	"context"
	"crypto/fips140"
	"errors"
	"fmt"
	"io"
	"strings"
	"time"

	"github.com/spf13/pflag"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// common are the flags every command shares; names are kube-apiserver's.
type common struct {
	// etcd is how to reach etcd, configured as the encryption layer's own clients are.
	etcd       layer.Etcd
	etcdPrefix string
	// src is where the configuration is kept: a file or a Secret's key.
	src       sourceFlags
	resources []string
	pageSize  int64
	kmsWait   time.Duration
	timeout   time.Duration
	// acknowledgedUnder is the coordination prefix whose acknowledged unreadable objects
	// an inventory counts apart ("" counts none).
	acknowledgedUnder string
	// skipPreflight: --skip-preflight (check-config, rotate --provider kms).
	skipPreflight bool
	// retention: --backup-retention (check-config, rotate --remove-old and --wait).
	retention backupRetention
}

// addPreflightFlag adds --skip-preflight to the commands that accept or write a
// configuration naming new KMS v2 plugins.
func (c *common) addPreflightFlag(fs *pflag.FlagSet) {
	fs.BoolVar(&c.skipPreflight, "skip-preflight", false, "Do not call the KMS v2 plugins of the new configuration (Status, then an Encrypt/Decrypt round trip) before accepting or writing it; for preparing a configuration where the plugins are not reachable (air-gapped). A warning is printed.")
}

// preflight calls every KMS v2 plugin next names, as an apiserver is about to
// (kmsv2.PreflightConfig), unless --skip-preflight: then it says loudly on stderr
// that nothing was checked. what names the configuration in those lines.
func (c *common) preflight(ctx context.Context, stderr io.Writer, next *config.Config, what string) error {
	providers := kmsv2.KMSv2Providers(next)
	if len(providers) == 0 {
		return nil
	}
	if c.skipPreflight {
		for _, p := range providers {
			fmt.Fprintf(stderr, "WARNING: --skip-preflight: KMS v2 provider %q at %s was not checked; %s may name a plugin that is down or cannot decrypt what it encrypts\n", p.Name, p.Endpoint, what)
		}
		return nil
	}
	if err := kmsv2.PreflightConfig(ctx, next); err != nil {
		return fmt.Errorf("%s is refused: %w", what, err)
	}
	return nil
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
	c.src.addFlags(fs)
	fs.StringSliceVar(&c.resources, "resources", nil, "Resources to scan: secrets, widgets.example.com, or deployments.apps=/registry/deployments/ for a custom etcd path. Default: every resource the configuration names explicitly (secrets and configmaps when it only has wildcards).")
	fs.Int64Var(&c.pageSize, "page-size", migrate.DefaultPageSize, "Objects per etcd range request.")
	fs.DurationVar(&c.kmsWait, "kms-wait", 15*time.Second, "How long to wait for KMS v2 plugins to report their current key id.")
}

// validate checks the flags every command that reads stored data needs.
func (c *common) validate() error {
	if err := c.validateEtcd(); err != nil {
		return err
	}
	if !c.src.given() {
		return errors.New("--encryption-provider-config (or --secret) is required: the keys that read the stored data are in it")
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
	// A read through the client's balancer, not a status call to one member: with one
	// member of three down (an upgrade, a reboot) the others answer, and every command
	// must work.
	if _, err := cli.Get(sctx, "health", clientv3.WithCountOnly()); err != nil {
		_ = cli.Close()
		return nil, fmt.Errorf("etcd does not answer at any of %s (%v); check --etcd-servers and the TLS flags", strings.Join(c.etcd.Servers, ","), err)
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
		var cfg *config.Config
		if cfg, err = c.loadSource(ctx); err == nil {
			s.cur, err = c.build(ctx, cfg, p.requireKMS)
		}
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

// processFIPSMode is this process's FIPS 140-3 mode (crypto/fips140), read at the edge
// and passed to the rule (transformers.FIPSRefusal).
func processFIPSMode() transformers.FIPSMode {
	return transformers.FIPSModeOf(fips140.Enabled(), fips140.Enforced())
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
	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{}), Logger: klog.Background(), FIPS: processFIPSMode()})
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

// inventory takes a fresh inventory of the resources cfgs cover (resolve), reading
// the stored objects with l's transformers and recording l's configuration hash.
func (c *common) inventory(ctx context.Context, cli *clientv3.Client, l *loaded, decryptCheck bool, cfgs ...*config.Config) (*migrate.Inventory, []migrate.Resource, error) {
	res, err := c.resolve(ctx, cli, cfgs...)
	if err != nil {
		return nil, nil, err
	}
	inv, err := c.inventoryOf(ctx, cli, l, decryptCheck, res)
	return inv, res.Resources, err
}

// inventoryOf is inventory of the resources res; it covers res's wildcard rules.
func (c *common) inventoryOf(ctx context.Context, cli *clientv3.Client, l *loaded, decryptCheck bool, res migrate.Resolution) (*migrate.Inventory, error) {
	return migrate.TakeInventory(ctx, c.inventoryOptions(cli, l, decryptCheck, res))
}

// inventoryOptions are the options of inventoryOf, for a command that sets more.
func (c *common) inventoryOptions(cli *clientv3.Client, l *loaded, decryptCheck bool, res migrate.Resolution) migrate.InventoryOptions {
	return migrate.InventoryOptions{
		Client: cli, Source: migrate.FromSet(l.set), Resources: res.Resources, Wildcards: res.Wildcards,
		PageSize: c.pageSize, DecryptCheck: decryptCheck, ConfigHash: l.cfg.Hash, CoordinationPrefix: c.acknowledgedUnder,
	}
}

// resolve lists the stored resources the rules of cfgs cover (all of them:
// check-config also scans what only the new configuration names), where kube-apiserver
// stores them: a named resource through kube's layout and the stored
// CustomResourceDefinitions, a wildcard rule ("*.*", "*.apps") as every stored resource
// it matches. --resources adds resources (a custom etcd path with name=/path/); it never
// narrows what the rules cover, since a key a rule reads may be in use by any of them.
// With no rule and no --resources, secrets and configmaps.
func (c *common) resolve(ctx context.Context, cli *clientv3.Client, cfgs ...*config.Config) (migrate.Resolution, error) {
	var rules []string
	for _, cfg := range cfgs {
		for _, e := range transformers.Describe(cfg) {
			rules = append(rules, e.Resources...)
		}
	}
	if len(rules) == 0 && len(c.resources) == 0 {
		rules = []string{"secrets", "configmaps"}
	}
	return c.withResources(ctx, cli, rules)
}

// withResources resolves rules (resources of rules as written in a file, wildcards
// included) into the stored resources they cover, plus every --resources entry (which
// may give a resource's etcd path): for decisions about rules, --resources only adds
// to what is scanned.
func (c *common) withResources(ctx context.Context, cli *clientv3.Client, rules []string) (migrate.Resolution, error) {
	layout := storagelayout.Kube(c.etcdPrefix)
	var extra []migrate.Resource
	for _, n := range c.resources {
		r, err := migrate.ParseResource(layout, n)
		if err != nil {
			return migrate.Resolution{}, fmt.Errorf("--resources: %w", err)
		}
		extra = append(extra, r)
	}
	var names []string
	seen := map[string]bool{}
	for _, r := range rules {
		if name := config.GroupResourceString(schema.ParseGroupResource(r)); !seen[name] {
			seen[name] = true
			names = append(names, name)
		}
	}
	r := &migrate.Resolver{Client: cli, Layout: layout, Skip: []string{layer.DefaultCoordinationPrefix(c.etcdPrefix)}, Extra: extra}
	return r.Resolve(ctx, names)
}

// storedIndex is what is stored under the etcd prefix, by resource: it resolves a
// rule into the resources stored under it without a request (the rotation machine's
// rotation.StoredFunc), a wildcard rule into every stored resource it matches.
type storedIndex struct{ stored []migrate.Resource }

// scanStored takes a storedIndex: the stored definitions, then a skip scan.
func (c *common) scanStored(ctx context.Context, cli *clientv3.Client) (storedIndex, error) {
	layout := storagelayout.Kube(c.etcdPrefix)
	if err := layout.AddStoredCRDs(ctx, cli); err != nil {
		return storedIndex{}, err
	}
	stored, _, err := layout.Stored(ctx, cli, layer.DefaultCoordinationPrefix(c.etcdPrefix))
	return storedIndex{stored: stored}, err
}

// resources are the resources stored under a rule naming ruleResources: each named
// one (stored or not: the inventory looks where it would be), and for a wildcard every
// stored resource of the groups it matches.
func (x storedIndex) resources(ruleResources []string) []string {
	var out []string
	seen := map[string]bool{}
	add := func(name string) {
		if !seen[name] {
			seen[name] = true
			out = append(out, name)
		}
	}
	for _, r := range ruleResources {
		gr := schema.ParseGroupResource(r)
		if gr.Resource != "*" {
			add(gr.String())
			continue
		}
		for _, loc := range x.stored {
			if transformers.RuleCovers(gr, loc.GroupResource) {
				add(loc.String())
			}
		}
	}
	return out
}
