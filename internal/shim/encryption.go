package shim

import (
	"context"
	"fmt"
	"net/http"

	"k8s.io/apimachinery/pkg/runtime/schema"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"

	"github.com/rekey-io/rekey/pkg/encryptionstate"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// StorageMigrationHookName is the post-start hook that starts the storage migration
// controller of the rekey layer.
const StorageMigrationHookName = layer.StorageMigrationHookName

// StorageStatusKey is the member of the status document that holds the storage
// inventory and the migration controller's state.
const StorageStatusKey = layer.StorageStatusKey

// ClusterStatusKey is the member of the status document that holds the cluster view
// (with --cluster-coordination).
const ClusterStatusKey = layer.ClusterStatusKey

// encryptionLayer puts a way of transforming stored values into a server config.
type encryptionLayer interface {
	// install sets c.ResourceTransformers and health checks (or configures etcd to do
	// so), then the storage through etcd.ApplyTo, and adds what keeps stored data on the
	// current keys (inventory and migration) as a post-start hook that stops with the
	// server.
	install(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error
	// checkStart runs once etcd answers and before anything is served: it refuses a
	// configuration that cannot read what the last applied one could.
	checkStart(ctx context.Context) error
	// statusPath and statusHandler describe the layer's status document ("" when none).
	statusPath() string
	statusHandler() http.Handler
	// publishEncryptionState has the layer keep the EncryptionState current through p
	// (a no-op on upstream's layer, which has no inventories).
	publishEncryptionState(p encryptionstate.Publisher)
	close()
}

// newEncryptionLayer builds the layer the flags chose; lo (rekeyLayerOptions, with
// Etcd set) serves the rekey layer.
func newEncryptionLayer(ctx context.Context, o *Options, lo layer.Options) (encryptionLayer, error) {
	if !o.Rekey.Rekey() {
		return &upstreamLayer{path: o.EncryptionConfig, reload: o.AutomaticReload}, nil
	}
	l, err := layer.New(ctx, lo)
	if err != nil {
		return nil, err
	}
	return rekeyLayer{l}, nil
}

// rekeyLayerOptions are pkg/layer's options for this shim: its flags of the layer
// (declared by pkg/layer, as in dist/kube-apiserver) and the shim's part. They are
// checked — with the configuration file — before etcd starts; Etcd is set once it runs.
func rekeyLayerOptions(o *Options, reg metrics.KubeRegistry, apiServerID string) (layer.Options, error) {
	lo := layer.Options{
		Flags:           o.Rekey,
		Path:            o.EncryptionConfig,
		AutomaticReload: o.AutomaticReload,
		KMS:             o.KMS,
		Resources:       storageResources(o.EtcdPrefix),
		EtcdPrefix:      o.EtcdPrefix,
		// k8s.io/apiserver's identity: the agent's metrics and the default state id. The
		// member key is the shim's --apiserver-id, which complete defaulted.
		Identity: apiServerID,
		Registry: reg,
		Logger:   o.Logger,
		// k8s.io/apiserver reports its watch caches' revisions in its global registry.
		WatchCacheMetrics: legacyregistry.DefaultGatherer,
	}
	if !o.Rekey.Rekey() || o.EncryptionConfig == "" {
		return lo, nil
	}
	if err := lo.Validate(); err != nil {
		return lo, err
	}
	return lo, lo.CheckFile()
}

// upstreamLayer leaves c.ResourceTransformers nil and hands the file to EtcdOptions,
// which loads it with encryptionconfig.LoadEncryptionConfig and installs its
// DynamicTransformers (reload on) or StaticTransformers, the kms-providers health
// check and the reload controller — kube-apiserver's own code path.
type upstreamLayer struct {
	path   string
	reload bool
}

func (u *upstreamLayer) install(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error {
	etcd.EncryptionProviderConfigFilepath = u.path
	etcd.EncryptionProviderConfigAutomaticReload = u.reload && u.path != ""
	return applyEtcd(etcd)(c)
}

func (u *upstreamLayer) checkStart(context.Context) error                 { return nil }
func (u *upstreamLayer) statusPath() string                               { return "" }
func (u *upstreamLayer) statusHandler() http.Handler                      { return nil }
func (u *upstreamLayer) close()                                           {}
func (u *upstreamLayer) publishEncryptionState(encryptionstate.Publisher) {}

// rekeyLayer is pkg/layer: the agent, the start-up check, the storage migration
// controller and, with --cluster-coordination, the cluster node.
type rekeyLayer struct{ l *layer.Layer }

// install is pkg/layer's one installation, as in dist/kube-apiserver, without Events:
// the shim serves no Events API to post them to (the layer logs every event's fact).
func (r rekeyLayer) install(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error {
	return r.l.InstallInto(c, layer.Installation{Storage: applyEtcd(etcd)})
}
func (r rekeyLayer) checkStart(ctx context.Context) error { return r.l.CheckStart(ctx) }
func (r rekeyLayer) statusPath() string                   { return r.l.StatusPath() }
func (r rekeyLayer) statusHandler() http.Handler          { return r.l.StatusHandler() }
func (r rekeyLayer) close()                               { r.l.Close() }
func (r rekeyLayer) publishEncryptionState(p encryptionstate.Publisher) {
	r.l.SetEncryptionStatePublisher(p)
}

// applyEtcd builds the storage of c from etcd: c.ResourceTransformers, when set, wraps
// every resource's storage config (EtcdOptions keeps a non-nil value).
func applyEtcd(etcd *genericoptions.EtcdOptions) func(*genericapiserver.Config) error {
	return func(c *genericapiserver.Config) error {
		if err := etcd.ApplyTo(c); err != nil {
			return fmt.Errorf("etcd storage: %w", err)
		}
		return nil
	}
}

// storageResources are the resources the shim stores.
func storageResources(etcdPrefix string) []migrate.Resource {
	return []migrate.Resource{
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "secrets"}),
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "configmaps"}),
	}
}
