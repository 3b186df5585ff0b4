package main

import (
	"context"
	"crypto/tls"
	"fmt"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"go.etcd.io/etcd/client/pkg/v3/transport"
	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	"k8s.io/apimachinery/pkg/util/wait"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	serverstorage "k8s.io/apiserver/pkg/server/storage"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	utilversion "k8s.io/component-base/version"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// Encryption layers; the flag exists for side-by-side measurements and interop tests.
const (
	layerRekey    = "rekey"
	layerUpstream = "upstream"
)

// storageMigrationHookName is the post-start hook that starts the storage migration
// controller; the shim uses the same name.
const storageMigrationHookName = "start-rekey-storage-migration"

// etcdDialTimeout bounds the migration controller's first connection to etcd.
const etcdDialTimeout = 10 * time.Second

// upstreamEncryptionMetricPrefixes are the families upstream's encryption packages
// register in the legacy registry at init. With rekey's layer on, that code never runs
// and rekey serves these names itself, so the legacy copies are left out of /metrics.
var upstreamEncryptionMetricPrefixes = []string{
	"apiserver_storage_transformation_",
	"apiserver_storage_envelope_transformation_",
	"apiserver_storage_data_key_generation_",
	"apiserver_envelope_encryption_",
	"apiserver_encryption_config_controller_",
}

// rekeyOptions are the flags this binary adds to kube-apiserver's. The names are the
// apiserver shim's.
type rekeyOptions struct {
	Layer                    string
	ReloadPollInterval       time.Duration
	StorageMigration         bool
	StorageMigrationRate     float64
	StorageResources         []string
	AllowDroppingKeysInUse   bool
	StorageCheckInterval     time.Duration
	StorageInventoryInterval time.Duration
	KMSStatusInterval        time.Duration
	KMSRetryInterval         time.Duration
	KMSWriteTTL              time.Duration
}

func newRekeyOptions() *rekeyOptions {
	return &rekeyOptions{Layer: layerRekey, StorageResources: []string{"secrets", "configmaps"}}
}

func (o *rekeyOptions) addFlags(fs *pflag.FlagSet) {
	fs.StringVar(&o.Layer, "encryption-layer", o.Layer,
		"Which code serves --encryption-provider-config: rekey (this build's point) or upstream (k8s.io/apiserver's own encryptionconfig, for comparisons).")
	fs.DurationVar(&o.ReloadPollInterval, "encryption-provider-config-poll-interval", 0,
		"With automatic reload, how often the file is re-read even without file events (default 1m).")
	fs.BoolVar(&o.StorageMigration, "storage-migration", false,
		"Re-encrypt stored objects of --storage-migration-resources when their write key changes. Without it inventories are still taken and guard reloads.")
	fs.Float64Var(&o.StorageMigrationRate, "storage-migration-rate", 0, "Maximum objects re-encrypted per second by --storage-migration; 0 is unlimited.")
	fs.StringSliceVar(&o.StorageResources, "storage-migration-resources", o.StorageResources,
		"Resources the inventory and migration scan: secrets, widgets.example.com, or deployments.apps=/registry/deployments/ for a built-in group stored elsewhere. Wildcards cannot be scanned.")
	fs.BoolVar(&o.AllowDroppingKeysInUse, "unsafe-allow-dropping-keys-in-use", false,
		"Let a reload drop a key that the latest inventory still finds in use. Objects under that key become unreadable.")
	fs.DurationVar(&o.StorageCheckInterval, "storage-migration-check-interval", 0, "How often write keys are compared (default 5s).")
	fs.DurationVar(&o.StorageInventoryInterval, "storage-inventory-interval", 0, "How often a fresh inventory is taken without a key change (default 10m).")
	fs.DurationVar(&o.KMSStatusInterval, "kms-status-interval", 0, "KMS v2 Status period while healthy (default 1m). For tests.")
	fs.DurationVar(&o.KMSRetryInterval, "kms-retry-interval", 0, "KMS v2 Status period while unhealthy (default 10s). For tests.")
	fs.DurationVar(&o.KMSWriteTTL, "kms-write-ttl", 0, "How long KMS v2 writes continue after the last healthy Status (default 3m). For tests.")
}

func (o *rekeyOptions) validate() []error {
	var errs []error
	if o.Layer != layerRekey && o.Layer != layerUpstream {
		errs = append(errs, fmt.Errorf("--encryption-layer=%q: must be %q or %q", o.Layer, layerRekey, layerUpstream))
	}
	if o.Layer == layerUpstream && o.StorageMigration {
		errs = append(errs, fmt.Errorf("--storage-migration needs --encryption-layer=%s: upstream's layer has no storage migration", layerRekey))
	}
	if o.StorageMigrationRate < 0 {
		errs = append(errs, fmt.Errorf("--storage-migration-rate=%v: must be 0 (unlimited) or positive", o.StorageMigrationRate))
	}
	for _, r := range o.StorageResources {
		if _, err := migrate.ParseResource(migrate.DefaultEtcdPrefix, r); err != nil {
			errs = append(errs, fmt.Errorf("--storage-migration-resources: %w", err))
		}
	}
	return errs
}

// printVersionAndExitIfRequested prints what upstream's --version prints plus that rekey
// is inside. --version=raw and other values are left to upstream's verflag.
func printVersionAndExitIfRequested(cmd *cobra.Command) {
	f := cmd.Flags().Lookup("version")
	if f == nil || f.Value.String() != "true" {
		return
	}
	fmt.Fprintf(cmd.OutOrStdout(), "Kubernetes %s (encryption at rest: rekey %s)\n", utilversion.Get(), rekeyVersion)
	os.Exit(0)
}

// layer is rekey inside one kube-apiserver: the agent, the storage migration controller
// and what they serve. With --encryption-layer=upstream, or without
// --encryption-provider-config, it does nothing.
type layer struct {
	opts *rekeyOptions
	reg  metrics.KubeRegistry
	log  klog.Logger

	// taken from kube-apiserver's etcd options before upstream could use them.
	path       string
	autoReload bool

	agent   *reload.Agent
	store   *migrate.InventoryStore
	metrics *migrate.Metrics

	mu     sync.Mutex
	ctrl   *migrate.Controller
	client *clientv3.Client
	cancel context.CancelFunc
	done   chan struct{}
}

func newLayer(o *rekeyOptions) *layer {
	return &layer{opts: o, reg: metrics.NewKubeRegistry(), log: klog.Background().WithName("rekey")}
}

func (l *layer) active() bool { return l.opts.Layer == layerRekey }

// takeEncryptionFlags moves --encryption-provider-config and its reload flag from
// kube-apiserver's etcd options to the layer, so BuildGenericConfig builds no transformers,
// health check or reload hook of its own; restore puts them back for later readers.
func (l *layer) takeEncryptionFlags(etcd *genericoptions.EtcdOptions) (restore func()) {
	if !l.active() {
		return func() {}
	}
	l.path, l.autoReload = etcd.EncryptionProviderConfigFilepath, etcd.EncryptionProviderConfigAutomaticReload
	etcd.EncryptionProviderConfigFilepath, etcd.EncryptionProviderConfigAutomaticReload = "", false
	return func() {
		etcd.EncryptionProviderConfigFilepath, etcd.EncryptionProviderConfigAutomaticReload = l.path, l.autoReload
	}
}

// install puts the agent where upstream's etcd options put their transformers: it
// becomes c.ResourceTransformers (which CreateAPIExtensionsConfig hands to CRD storage
// and CreateAggregatorConfig's etcd options pick up, so custom resources and APIServices
// are covered), adds the KMS checks to /healthz and /readyz and the reload loop as a
// post-start hook. c.RESTOptionsGetter was built before with no transformers; it is
// rebuilt the way EtcdOptions.ApplyWithStorageFactoryTo builds it, on the same storage
// factory, so the object count tracker, --etcd-servers-overrides and per-resource
// encodings stay.
func (l *layer) install(c *genericapiserver.Config, factory *serverstorage.DefaultStorageFactory, etcd *genericoptions.EtcdOptions) error {
	if !l.active() || l.path == "" {
		return nil
	}
	m, err := migrate.NewMetrics(l.reg)
	if err != nil {
		return fmt.Errorf("registering storage migration metrics: %w", err)
	}
	l.store, l.metrics = &migrate.InventoryStore{}, m
	allow := l.opts.AllowDroppingKeysInUse
	ctx := wait.ContextForChannel(c.DrainedNotify())
	agent, err := reload.NewAgent(ctx, reload.Options{
		Path:            l.path,
		AutomaticReload: l.autoReload,
		PollInterval:    l.opts.ReloadPollInterval,
		Transformers: transformers.Options{
			Logger:  l.log,
			Metrics: transformers.NewMetrics(l.reg),
			KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{
				Registry:       l.reg,
				StatusInterval: l.opts.KMSStatusInterval,
				RetryInterval:  l.opts.KMSRetryInterval,
				WriteTTL:       l.opts.KMSWriteTTL,
			}),
		},
		Registry:     l.reg,
		APIServerID:  c.APIServerID,
		KMSv1Error:   config.KMSv1UnsupportedError,
		Logger:       l.log,
		Guard:        migrate.NewGuard(l.store, func() bool { return allow }, m, l.log),
		StatusExtras: func() map[string]any { return map[string]any{"storage": l.storageStatus()} },
	})
	if err != nil {
		return err
	}
	l.agent = agent
	if err := agent.InstallInto(c); err != nil {
		return err
	}
	c.RESTOptionsGetter = etcd.CreateRESTOptionsGetter(factory, agent)
	if err := l.addStorageMigration(c, etcd); err != nil {
		return err
	}
	go func() {
		<-c.DrainedNotify()
		l.close()
	}()
	return nil
}

// addStorageMigration starts the inventory and migration controller after the server
// has started, with an etcd client of its own on kube-apiserver's etcd flags.
func (l *layer) addStorageMigration(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error {
	prefix := etcd.StorageConfig.Prefix
	var resources []migrate.Resource
	for _, s := range l.opts.StorageResources {
		r, err := migrate.ParseResource(prefix, s)
		if err != nil {
			return fmt.Errorf("--storage-migration-resources: %w", err)
		}
		resources = append(resources, r)
	}
	tr := etcd.StorageConfig.Transport
	return c.AddPostStartHook(storageMigrationHookName, func(hc genericapiserver.PostStartHookContext) error {
		var tlsConfig *tls.Config
		if tr.CertFile != "" || tr.KeyFile != "" || tr.TrustedCAFile != "" {
			info := transport.TLSInfo{CertFile: tr.CertFile, KeyFile: tr.KeyFile, TrustedCAFile: tr.TrustedCAFile}
			var err error
			if tlsConfig, err = info.ClientConfig(); err != nil {
				return fmt.Errorf("storage migration: etcd TLS from --etcd-certfile, --etcd-keyfile, --etcd-cafile: %w", err)
			}
		}
		cli, err := clientv3.New(clientv3.Config{Endpoints: tr.ServerList, TLS: tlsConfig, DialTimeout: etcdDialTimeout, Logger: zap.NewNop()})
		if err != nil {
			return fmt.Errorf("storage migration: etcd client for %v: %w", tr.ServerList, err)
		}
		agent := l.agent
		ctrl := migrate.NewController(migrate.ControllerOptions{
			Client:            cli,
			Source:            migrate.FromRules(agent, agent.Rules),
			Resources:         resources,
			AutoMigrate:       l.opts.StorageMigration,
			CheckInterval:     l.opts.StorageCheckInterval,
			InventoryInterval: l.opts.StorageInventoryInterval,
			Rate:              l.opts.StorageMigrationRate,
			ConfigHash:        func() string { return agent.ActiveConfig().Hash },
			Inventory:         l.store,
			Metrics:           l.metrics,
			Logger:            l.log,
		})
		ctx, cancel := context.WithCancel(hc.Context)
		done := make(chan struct{})
		l.mu.Lock()
		l.ctrl, l.client, l.cancel, l.done = ctrl, cli, cancel, done
		l.mu.Unlock()
		go func() {
			defer close(done)
			ctrl.Run(ctx)
		}()
		l.log.Info("Started storage migration controller", "automaticMigration", l.opts.StorageMigration,
			"resources", l.opts.StorageResources, "etcdPrefix", prefix)
		return nil
	})
}

func (l *layer) storageStatus() migrate.ControllerStatus {
	l.mu.Lock()
	ctrl := l.ctrl
	l.mu.Unlock()
	if ctrl != nil {
		return ctrl.Status()
	}
	return migrate.ControllerStatus{AutoMigrate: l.opts.StorageMigration, Inventory: l.store.Latest()}
}

// serveMetrics makes GET /metrics on the outermost server (the aggregator) serve the
// legacy registry and rekey's registry as one, each name once.
func (l *layer) serveMetrics(c *genericapiserver.Config) {
	if l.agent == nil {
		return
	}
	h := promhttp.HandlerFor(mergedGatherer{rekey: l.reg, legacy: legacyregistry.DefaultGatherer},
		promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
	next := c.BuildHandlerChainFunc
	c.BuildHandlerChainFunc = func(apiHandler http.Handler, c *genericapiserver.Config) http.Handler {
		return next(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/metrics" && r.Method == http.MethodGet {
				h.ServeHTTP(w, r)
				return
			}
			apiHandler.ServeHTTP(w, r)
		}), c)
	}
}

// attach serves the status document on the outermost server, behind its authentication
// and authorization (a non-resource URL: grant `get` on /rekey/status).
func (l *layer) attach(s *genericapiserver.GenericAPIServer) {
	if l.agent == nil {
		return
	}
	s.Handler.NonGoRestfulMux.Handle(reload.StatusPath, l.agent.StatusHandler())
}

func (l *layer) close() {
	l.mu.Lock()
	cancel, done, cli := l.cancel, l.done, l.client
	l.cancel = nil
	l.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
		_ = cli.Close()
	}
	if l.agent != nil {
		l.agent.Close()
	}
}

// mergedGatherer serves rekey's families and the legacy registry's others. Upstream's
// encryption families are dropped from the legacy side: that code does not run here, and
// a name must not appear twice.
type mergedGatherer struct {
	rekey, legacy prometheus.Gatherer
}

func (g mergedGatherer) Gather() ([]*dto.MetricFamily, error) {
	ours, errOurs := g.rekey.Gather()
	theirs, errTheirs := g.legacy.Gather()
	names := make(map[string]bool, len(ours))
	for _, mf := range ours {
		names[mf.GetName()] = true
	}
	out := slices.Clone(ours)
	for _, mf := range theirs {
		if names[mf.GetName()] || isUpstreamEncryptionMetric(mf.GetName()) {
			continue
		}
		out = append(out, mf)
	}
	sort.Slice(out, func(i, j int) bool { return out[i].GetName() < out[j].GetName() })
	if errOurs != nil {
		return out, errOurs
	}
	return out, errTheirs
}

func isUpstreamEncryptionMetric(name string) bool {
	for _, p := range upstreamEncryptionMetricPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}
