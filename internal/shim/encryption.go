package shim

import (
	"context"
	"fmt"
	"net/http"

	"k8s.io/apimachinery/pkg/runtime/schema"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/component-base/metrics"

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

// Encryption layers the shim can run with.
const (
	// LayerRekey is the agent: rekey's config loader, transformers and reload.
	LayerRekey = "rekey"
	// LayerUpstream is k8s.io/apiserver's own encryptionconfig package, wired exactly as
	// kube-apiserver wires it; it exists for side-by-side benchmarks and interop tests.
	LayerUpstream = "upstream"
)

// encryptionLayer puts a way of transforming stored values into a server config.
type encryptionLayer interface {
	// install runs before etcd.ApplyTo: it sets c.ResourceTransformers and health
	// checks, or configures etcd to do so.
	install(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error
	// checkStart runs once etcd answers and before anything is served: it refuses a
	// configuration that cannot read what the last applied one could.
	checkStart(ctx context.Context, etcd layer.Etcd, stateID string) error
	// startStorage adds what keeps stored data on the current keys (inventory and
	// migration) as a post-start hook; it stops with the server.
	startStorage(c *genericapiserver.Config) error
	// statusPath and statusHandler describe the layer's status document ("" when none).
	statusPath() string
	statusHandler() http.Handler
	close()
}

// newEncryptionLayer builds the layer. Coordination with other apiservers (o.clustered)
// needs etcd up and etcd set; otherwise checkStart passes it.
func newEncryptionLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry, apiServerID string, etcd layer.Etcd) (encryptionLayer, error) {
	switch o.EncryptionLayer {
	case "", LayerRekey:
		l, err := layer.New(ctx, rekeyLayerOptions(o, reg, apiServerID, etcd))
		if err != nil {
			return nil, err
		}
		return rekeyLayer{l}, nil
	case LayerUpstream:
		return &upstreamLayer{path: o.EncryptionConfig, reload: o.AutomaticReload}, nil
	default:
		return nil, fmt.Errorf("--encryption-layer=%q: must be %q or %q", o.EncryptionLayer, LayerRekey, LayerUpstream)
	}
}

// rekeyLayerOptions maps the shim's options onto pkg/layer, which dist/kube-apiserver
// wires the same way.
func rekeyLayerOptions(o *Options, reg metrics.KubeRegistry, apiServerID string, etcd layer.Etcd) layer.Options {
	return layer.Options{
		Path:                     o.EncryptionConfig,
		AutomaticReload:          o.AutomaticReload,
		ReloadPollInterval:       o.ReloadPollInterval,
		KMS:                      o.KMS,
		KMSStatusInterval:        o.KMSTimings.StatusInterval,
		KMSRetryInterval:         o.KMSTimings.RetryInterval,
		KMSWriteTTL:              o.KMSTimings.WriteTTL,
		Etcd:                     etcd,
		Resources:                storageResources(o.EtcdPrefix),
		EtcdPrefix:               o.EtcdPrefix,
		StorageMigration:         o.StorageMigration,
		StorageMigrationRate:     o.StorageMigrationRate,
		StorageCheckInterval:     o.StorageCheckInterval,
		StorageInventoryInterval: o.StorageInventoryInterval,
		AllowDroppingKeysInUse:   o.AllowDroppingKeysInUse,
		EncryptionStateFile:      o.EncryptionStateFile,
		// The agent's metrics carry k8s.io/apiserver's identity, the member key the
		// shim's --apiserver-id.
		APIServerID:              apiServerID,
		MemberID:                 o.APIServerID,
		Cluster:                  o.clustered(),
		CoordinationPrefix:       o.CoordinationPrefix,
		ClusterLeaseTTL:          o.ClusterLeaseTTL,
		ClusterDisagreementAlarm: o.ClusterDisagreementAlarm,
		Registry:                 reg,
		Logger:                   o.Logger,
	}
}

// upstreamLayer leaves c.ResourceTransformers nil and hands the file to EtcdOptions,
// which loads it with encryptionconfig.LoadEncryptionConfig and installs its
// DynamicTransformers (reload on) or StaticTransformers, the kms-providers health
// check and the reload controller — kube-apiserver's own code path.
type upstreamLayer struct {
	path   string
	reload bool
}

func (u *upstreamLayer) install(_ *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error {
	etcd.EncryptionProviderConfigFilepath = u.path
	etcd.EncryptionProviderConfigAutomaticReload = u.reload && u.path != ""
	return nil
}

func (u *upstreamLayer) checkStart(context.Context, layer.Etcd, string) error { return nil }
func (u *upstreamLayer) startStorage(*genericapiserver.Config) error          { return nil }
func (u *upstreamLayer) statusPath() string                                   { return "" }
func (u *upstreamLayer) statusHandler() http.Handler                          { return nil }
func (u *upstreamLayer) close()                                               {}

// rekeyLayer is pkg/layer: the agent, the start-up check, the storage migration
// controller and, with --cluster-coordination, the cluster node.
type rekeyLayer struct{ l *layer.Layer }

func (r rekeyLayer) install(c *genericapiserver.Config, _ *genericoptions.EtcdOptions) error {
	return r.l.Install(c)
}
func (r rekeyLayer) checkStart(ctx context.Context, etcd layer.Etcd, stateID string) error {
	r.l.SetEtcd(etcd) // an embedded etcd starts after the layer
	return r.l.CheckStart(ctx, stateID)
}
func (r rekeyLayer) startStorage(c *genericapiserver.Config) error { return r.l.AddStorageHook(c) }
func (r rekeyLayer) statusPath() string                            { return r.l.StatusPath() }
func (r rekeyLayer) statusHandler() http.Handler                   { return r.l.StatusHandler() }
func (r rekeyLayer) close()                                        { r.l.Close() }

// storageResources are the resources the shim stores.
func storageResources(etcdPrefix string) []migrate.Resource {
	return []migrate.Resource{
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "secrets"}),
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "configmaps"}),
	}
}
