package main

import (
	"fmt"
	"net/http"
	"os"
	"slices"
	"sort"
	"strings"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"
	"github.com/spf13/cobra"
	"k8s.io/apimachinery/pkg/util/wait"
	"k8s.io/apiserver/pkg/registry/generic"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	serverstorage "k8s.io/apiserver/pkg/server/storage"
	svmclient "k8s.io/client-go/kubernetes/typed/storagemigration/v1"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	utilversion "k8s.io/component-base/version"
	"k8s.io/klog/v2"

	rekeylayer "github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/storagelayout"
)

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

// newRekeyFlags are the flags this binary adds to kube-apiserver's: pkg/layer's, declared
// there once for this binary and the apiserver shim, with this binary's defaults
// (layer.KubeAPIServerDefaults says where and why they differ from the shim's).
func newRekeyFlags() *rekeylayer.Flags {
	f := rekeylayer.NewFlags(rekeylayer.KubeAPIServerDefaults())
	return &f
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
	flags *rekeylayer.Flags
	reg   metrics.KubeRegistry
	log   klog.Logger

	// taken from kube-apiserver's etcd options before upstream could use them.
	path       string
	autoReload bool

	rekey *rekeylayer.Layer
	// layout is where this apiserver stores each resource: kube's table, then what the
	// getters report as the servers build their storage (custom resources included).
	layout *storagelayout.Layout
}

func newLayer(f *rekeylayer.Flags) *layer {
	return &layer{flags: f, reg: metrics.NewKubeRegistry(), log: klog.Background().WithName("rekey")}
}

func (l *layer) active() bool { return l.flags.Rekey() }

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
// layer's one etcd client uses kube-apiserver's --etcd-servers and TLS files.
func (l *layer) install(c *genericapiserver.Config, factory *serverstorage.DefaultStorageFactory, etcd *genericoptions.EtcdOptions) error {
	if !l.active() || l.path == "" {
		return nil
	}
	tr := etcd.StorageConfig.Transport
	l.layout = storagelayout.Kube(etcd.StorageConfig.Prefix)
	o := rekeylayer.Options{
		Flags:           *l.flags,
		Path:            l.path,
		AutomaticReload: l.autoReload,
		Etcd:            rekeylayer.Etcd{Servers: tr.ServerList, CAFile: tr.TrustedCAFile, CertFile: tr.CertFile, KeyFile: tr.KeyFile},
		EtcdPrefix:      etcd.StorageConfig.Prefix,
		Layout:          l.layout,
		// kube-apiserver's identity: the agent's metrics, and the default of
		// --apiserver-id and --encryption-state-id.
		Identity: c.APIServerID,
		Registry: l.reg,
		Logger:   l.log,
		// k8s.io/apiserver reports its watch caches' revisions in its global registry.
		WatchCacheMetrics: legacyregistry.DefaultGatherer,
	}
	// The elected migrator's migrations, mirrored as StorageVersionMigrations through
	// the loopback client (served by the time the migrator, a post-start hook, runs).
	if c.LoopbackClientConfig != nil {
		svm, err := svmclient.NewForConfig(c.LoopbackClientConfig)
		if err != nil {
			return fmt.Errorf("storage version migration client: %w", err)
		}
		o.MigrationMirror = newSVMMirror(svm.StorageVersionMigrations(), l.log)
	}
	ctx := wait.ContextForChannel(c.DrainedNotify())
	rl, err := rekeylayer.New(ctx, o)
	if err != nil {
		return err
	}
	l.rekey = rl
	// The EncryptionState, a custom resource the migration leader writes through the
	// loopback client (encryptionstate.go).
	if c.LoopbackClientConfig != nil {
		p, err := newCRDStatePublisher(c.LoopbackClientConfig)
		if err != nil {
			return err
		}
		rl.SetEncryptionStatePublisher(p)
	}
	go func() {
		<-c.DrainedNotify()
		l.close()
	}()
	if err := rl.CheckStart(ctx); err != nil {
		return err
	}
	return rl.InstallInto(c, rekeylayer.Installation{
		Storage: func(c *genericapiserver.Config) error {
			c.RESTOptionsGetter = rekeylayer.WithLayoutRecording(etcd.CreateRESTOptionsGetter(factory, c.ResourceTransformers), l.layout)
			return nil
		},
		// Events about this apiserver's identity Lease, where `kubectl get events -n
		// kube-system` shows them next to the apiserver's own.
		EventsAbout: rekeylayer.APIServerLease(c.APIServerID),
		// The aggregator's chain answers the clients: wrapOutermost times them there.
		ClientsServedElsewhere: true,
	})
}

// answerRefusedWrites makes the storage the getters build answer a write the write
// fence refuses with its 503 (rekeylayer.WithRefusedWrites). The apiextensions and
// aggregator servers build their getters from their own copies of the etcd options on
// the layer's transformers, after install, so InstallInto's wrapping of the kube
// getter does not reach them. The same getters report where they store each resource
// (custom resources as their definitions are served) to the layer's layout.
func (l *layer) answerRefusedWrites(getters ...*generic.RESTOptionsGetter) {
	if l.rekey == nil || !l.rekey.Active() {
		return
	}
	for _, g := range getters {
		*g = rekeylayer.WithLayoutRecording(rekeylayer.WithRefusedWrites(*g), l.layout)
	}
}

// wrapOutermost is the layer's part of the outermost server's (the aggregator's)
// handler chain, the only one every client request goes through: GET /metrics serves
// the legacy registry and rekey's registry as one, each name once, every request
// is timed for the storage migration's pacing (AddServingLatency), and users' writes of
// the EncryptionState are refused (refuseStateWrites).
func (l *layer) wrapOutermost(c *genericapiserver.Config) {
	if l.rekey == nil || !l.rekey.Active() {
		return
	}
	l.rekey.AddServingLatency(c)
	h := promhttp.HandlerFor(mergedGatherer{rekey: l.reg, legacy: legacyregistry.DefaultGatherer},
		promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
	next := c.BuildHandlerChainFunc
	c.BuildHandlerChainFunc = func(apiHandler http.Handler, c *genericapiserver.Config) http.Handler {
		api := refuseStateWrites(apiHandler)
		return next(http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			if r.URL.Path == "/metrics" && r.Method == http.MethodGet {
				h.ServeHTTP(w, r)
				return
			}
			api.ServeHTTP(w, r)
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
