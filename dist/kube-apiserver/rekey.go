package main

import (
	"fmt"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/spf13/cobra"
	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/util/wait"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	serverstorage "k8s.io/apiserver/pkg/server/storage"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	utilversion "k8s.io/component-base/version"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	rekeylayer "github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// Encryption layers; the flag exists for side-by-side measurements and interop tests.
const (
	layerRekey    = "rekey"
	layerUpstream = "upstream"
)

// defaultKMSStatusInterval is the shim's: shorter than kube-apiserver's minute so that a
// plugin's new key id reaches the write fence and the migrator quickly.
const defaultKMSStatusInterval = 15 * time.Second

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
// apiserver shim's; pkg/layer wires both the same way.
type rekeyOptions struct {
	Layer                    string
	ReloadPollInterval       time.Duration
	StorageMigration         bool
	StorageMigrationRate     float64
	StorageResources         []string
	AllowDroppingKeysInUse   bool
	StorageCheckInterval     time.Duration
	StorageInventoryInterval time.Duration
	EncryptionStateID        string
	EncryptionStateFile      string
	KMSStatusInterval        time.Duration
	KMSRetryInterval         time.Duration
	KMSWriteTTL              time.Duration

	APIServerID              string
	ClusterCoordination      bool
	CoordinationPrefix       string
	ClusterLeaseTTL          time.Duration
	ClusterDisagreementAlarm time.Duration
}

func newRekeyOptions() *rekeyOptions {
	return &rekeyOptions{
		Layer: layerRekey, StorageResources: []string{"secrets", "configmaps"},
		KMSStatusInterval:        defaultKMSStatusInterval,
		ClusterCoordination:      true,
		CoordinationPrefix:       cluster.DefaultPrefix,
		ClusterLeaseTTL:          cluster.DefaultLeaseTTL,
		ClusterDisagreementAlarm: cluster.DefaultDisagreementAlarm,
	}
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
		"Let a reload drop a key that the latest inventory still finds in use, or start with a configuration that cannot read what the last applied one could. "+
			"Objects under that key become unreadable.")
	fs.StringVar(&o.EncryptionStateFile, "encryption-state-file", "",
		"Keep the record of what the last applied encryption configuration could read (key fingerprints, never keys) in this file instead of "+
			"etcd key /rekey/applied/<encryption-state-id>. It must survive restarts: at start the configuration on disk is checked against it.")
	fs.StringVar(&o.EncryptionStateID, "encryption-state-id", "",
		"The id in the applied-state key /rekey/applied/<id>. Default: kube-apiserver's own identity (apiserver-<hash of the host name>). "+
			"Set it when several apiservers share one host and one etcd; it must stay the same across restarts.")
	fs.DurationVar(&o.StorageCheckInterval, "storage-migration-check-interval", 0, "How often write keys are compared (default 5s).")
	fs.DurationVar(&o.StorageInventoryInterval, "storage-inventory-interval", 0, "How often a fresh inventory is taken without a key change (default 10m).")
	fs.DurationVar(&o.KMSStatusInterval, "kms-status-interval", o.KMSStatusInterval,
		"How often a healthy KMS v2 plugin is asked for its Status (upstream: 1m). A plugin's new key id is seen within one interval; "+
			"with --cluster-coordination it is then published to the other apiservers at once.")
	fs.DurationVar(&o.KMSRetryInterval, "kms-retry-interval", 0, "KMS v2 Status period while unhealthy (default 10s). For tests.")
	fs.DurationVar(&o.KMSWriteTTL, "kms-write-ttl", 0, "How long KMS v2 writes continue after the last healthy Status (default 3m). For tests.")

	fs.StringVar(&o.APIServerID, "apiserver-id", "",
		"This apiserver's name among the apiservers sharing --etcd-servers (its member key under --coordination-prefix). "+
			"Default: kube-apiserver's own identity, apiserver-<hash of the host name>, the name of its Lease in kube-system. "+
			"Set it when several apiservers run on one host.")
	fs.BoolVar(&o.ClusterCoordination, "cluster-coordination", o.ClusterCoordination,
		"Coordinate with the other rekey apiservers through etcd: publish this apiserver's keys under a lease, never start writing with a key "+
			"another live apiserver cannot read (hold it, promote it once all can), migrate stored data on one elected apiserver, and fail "+
			"the rekey-cluster check of /readyz while this configuration cannot read a key the cluster uses. False: act alone.")
	fs.StringVar(&o.CoordinationPrefix, "coordination-prefix", o.CoordinationPrefix,
		"etcd key prefix of the coordination keys (members, migration leader, checkpoint); must be outside --etcd-prefix.")
	fs.DurationVar(&o.ClusterLeaseTTL, "cluster-lease-ttl", o.ClusterLeaseTTL,
		"Lease of this apiserver's member key and election session: a dead apiserver stops counting this long after it died (whole seconds, at least 2s).")
	fs.DurationVar(&o.ClusterDisagreementAlarm, "cluster-disagreement-alarm", o.ClusterDisagreementAlarm,
		"Raise an alarm (metric rekey_cluster_disagreement_alarm, status condition, log line) when the apiservers disagree about a write key for longer than this.")
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
	// The coordination prefix is checked against --etcd-prefix when the layer starts.
	if o.ClusterCoordination && o.Layer == layerRekey && o.APIServerID != "" {
		if err := cluster.ValidateID(o.APIServerID); err != nil {
			errs = append(errs, err)
		}
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

// layer is rekey inside one kube-apiserver: pkg/layer (the agent, the start-up check, the
// storage migration controller and the cluster node, wired as in the apiserver shim)
// and what this binary adds around it. With --encryption-layer=upstream, or without
// --encryption-provider-config, it does nothing.
type layer struct {
	opts *rekeyOptions
	reg  metrics.KubeRegistry
	log  klog.Logger

	// taken from kube-apiserver's etcd options before upstream could use them.
	path       string
	autoReload bool

	rekey *rekeylayer.Layer
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
// are covered), adds the KMS checks to /healthz and /readyz (and rekey-cluster to
// /readyz with coordination) and the reload loop and storage migration as post-start
// hooks. Before that it checks the configuration against the applied state in etcd.
// c.RESTOptionsGetter was built before with no transformers; it is rebuilt the way
// EtcdOptions.ApplyWithStorageFactoryTo builds it, on the same storage factory, so the
// object count tracker, --etcd-servers-overrides and per-resource encodings stay. The
// layer's own etcd clients use kube-apiserver's --etcd-servers and TLS files.
func (l *layer) install(c *genericapiserver.Config, factory *serverstorage.DefaultStorageFactory, etcd *genericoptions.EtcdOptions) error {
	if !l.active() || l.path == "" {
		return nil
	}
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
	memberID := l.opts.APIServerID
	if memberID == "" {
		memberID = c.APIServerID
	}
	ctx := wait.ContextForChannel(c.DrainedNotify())
	rl, err := rekeylayer.New(ctx, rekeylayer.Options{
		Path:                     l.path,
		AutomaticReload:          l.autoReload,
		ReloadPollInterval:       l.opts.ReloadPollInterval,
		KMSStatusInterval:        l.opts.KMSStatusInterval,
		KMSRetryInterval:         l.opts.KMSRetryInterval,
		KMSWriteTTL:              l.opts.KMSWriteTTL,
		KMSv1Error:               config.KMSv1UnsupportedError,
		Etcd:                     rekeylayer.Etcd{Servers: tr.ServerList, CAFile: tr.TrustedCAFile, CertFile: tr.CertFile, KeyFile: tr.KeyFile},
		Resources:                resources,
		EtcdPrefix:               prefix,
		StorageMigration:         l.opts.StorageMigration,
		StorageMigrationRate:     l.opts.StorageMigrationRate,
		StorageCheckInterval:     l.opts.StorageCheckInterval,
		StorageInventoryInterval: l.opts.StorageInventoryInterval,
		AllowDroppingKeysInUse:   l.opts.AllowDroppingKeysInUse,
		EncryptionStateFile:      l.opts.EncryptionStateFile,
		APIServerID:              c.APIServerID,
		MemberID:                 memberID,
		Cluster:                  l.opts.ClusterCoordination,
		CoordinationPrefix:       l.opts.CoordinationPrefix,
		ClusterLeaseTTL:          l.opts.ClusterLeaseTTL,
		ClusterDisagreementAlarm: l.opts.ClusterDisagreementAlarm,
		Registry:                 l.reg,
		Logger:                   l.log,
	})
	if err != nil {
		return err
	}
	l.rekey = rl
	go func() {
		<-c.DrainedNotify()
		l.close()
	}()
	stateID := l.opts.EncryptionStateID
	if stateID == "" {
		stateID = c.APIServerID
	}
	if err := rl.CheckStart(ctx, stateID); err != nil {
		return err
	}
	if err := rl.Install(c); err != nil {
		return err
	}
	c.RESTOptionsGetter = etcd.CreateRESTOptionsGetter(factory, rl.Agent())
	return rl.AddStorageHook(c)
}

// serveMetrics makes GET /metrics on the outermost server (the aggregator) serve the
// legacy registry and rekey's registry as one, each name once.
func (l *layer) serveMetrics(c *genericapiserver.Config) {
	if l.rekey == nil || !l.rekey.Active() {
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
	if l.rekey == nil || !l.rekey.Active() {
		return
	}
	s.Handler.NonGoRestfulMux.Handle(l.rekey.StatusPath(), l.rekey.StatusHandler())
}

func (l *layer) close() {
	if l.rekey != nil {
		l.rekey.Close()
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
