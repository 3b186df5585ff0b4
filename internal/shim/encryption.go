package shim

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// StorageMigrationHookName is the post-start hook that starts the storage migration
// controller of the rekey layer.
const StorageMigrationHookName = "start-rekey-storage-migration"

// StorageStatusKey is the member of the status document that holds the storage
// inventory and the migration controller's state.
const StorageStatusKey = "storage"

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
	checkStart(ctx context.Context, etcd etcdConn, stateID string) error
	// startStorage adds what keeps stored data on the current keys (inventory and
	// migration against etcd) as a post-start hook; it stops with the server.
	startStorage(c *genericapiserver.Config, etcd etcdConn) error
	// statusPath and statusHandler describe the layer's status document ("" when none).
	statusPath() string
	statusHandler() http.Handler
	close()
}

// newEncryptionLayer builds the layer; etcd is set (etcd is up) only when the rekey
// layer coordinates with other apiservers.
func newEncryptionLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry, apiServerID string, etcd *etcdConn) (encryptionLayer, error) {
	switch o.EncryptionLayer {
	case "", LayerRekey:
		return newRekeyLayer(ctx, o, reg, apiServerID, etcd)
	case LayerUpstream:
		return &upstreamLayer{path: o.EncryptionConfig, reload: o.AutomaticReload}, nil
	default:
		return nil, fmt.Errorf("--encryption-layer=%q: must be %q or %q", o.EncryptionLayer, LayerRekey, LayerUpstream)
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

func (u *upstreamLayer) checkStart(context.Context, etcdConn, string) error    { return nil }
func (u *upstreamLayer) startStorage(*genericapiserver.Config, etcdConn) error { return nil }
func (u *upstreamLayer) statusPath() string                                    { return "" }
func (u *upstreamLayer) statusHandler() http.Handler                           { return nil }
func (u *upstreamLayer) close()                                                {}

// rekeyLayer is the agent: it loads and watches the file, swaps configurations and
// serves the kms-providers check and the status document. Next to it runs the storage
// migration controller: it takes inventories of the stored Secrets and ConfigMaps,
// re-encrypts them when a write key changes (unless StorageMigration is off), and its
// inventories feed the guard that refuses a reload dropping a key still in use.
type rekeyLayer struct {
	agent *reload.Agent
	// store is the latest inventory, shared by the controller and the guard.
	store   *migrate.InventoryStore
	metrics *migrate.Metrics
	opts    storageOptions
	log     klog.Logger

	// node coordinates with the other apiservers (nil without --cluster-coordination);
	// nodeClient is its etcd client.
	node       *cluster.Node
	nodeClient *clientv3.Client

	mu sync.Mutex
	// state persists what the applied configuration can read (checkStart sets it);
	// stateClient is its etcd client, also used by the decrypt guard.
	state       migrate.AppliedStateStore
	stateClient *clientv3.Client
	ctrl        *migrate.Controller
	migrator    *cluster.Migrator
	client      *clientv3.Client
	cancel      context.CancelFunc
	done        chan struct{}
}

// storageOptions are the parts of Options the controller uses.
type storageOptions struct {
	autoMigrate       bool
	allowDropping     bool
	etcdPrefix        string
	rate              float64
	checkInterval     time.Duration
	inventoryInterval time.Duration
	leaseTTL          time.Duration
	stateFile         string
}

func newRekeyLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry, apiServerID string, etcd *etcdConn) (_ *rekeyLayer, err error) {
	if o.EncryptionConfig == "" {
		return &rekeyLayer{}, nil
	}
	m, err := migrate.NewMetrics(reg)
	if err != nil {
		return nil, fmt.Errorf("registering storage migration metrics: %w", err)
	}
	store := &migrate.InventoryStore{}
	var node *cluster.Node
	var nodeClient *clientv3.Client
	if etcd != nil {
		if node, nodeClient, err = startClusterNode(ctx, o, reg, *etcd, store); err != nil {
			return nil, err
		}
		defer func() {
			if err != nil {
				node.Close()
				_ = nodeClient.Close()
			}
		}()
	}
	r := &rekeyLayer{
		store:      store,
		metrics:    m,
		log:        o.Logger,
		node:       node,
		nodeClient: nodeClient,
		opts: storageOptions{
			autoMigrate:       o.StorageMigration,
			allowDropping:     o.AllowDroppingKeysInUse,
			etcdPrefix:        o.EtcdPrefix,
			rate:              o.StorageMigrationRate,
			checkInterval:     o.StorageCheckInterval,
			inventoryInterval: o.StorageInventoryInterval,
			leaseTTL:          o.ClusterLeaseTTL,
			stateFile:         o.EncryptionStateFile,
		},
	}
	allow := r.opts.allowDropping
	ropts := reload.Options{
		Path:            o.EncryptionConfig,
		AutomaticReload: o.AutomaticReload,
		PollInterval:    o.ReloadPollInterval,
		Transformers: transformers.Options{
			Logger:  o.Logger,
			Metrics: transformers.NewMetrics(reg),
			KMS:     kmsFactory(o, reg, node),
		},
		Registry:    reg,
		APIServerID: apiServerID,
		Logger:      o.Logger,
		Guard:       migrate.NewGuard(r.store, func() bool { return allow }, m, o.Logger),
		SetGuard: migrate.NewDecryptGuard(migrate.DecryptGuardOptions{
			Inventory: r.store,
			Client:    r.etcdClient,
			Override:  func() bool { return allow },
			Metrics:   m,
			Logger:    o.Logger,
		}),
		Applied:      r.saveApplied,
		StatusExtras: func() map[string]any { return map[string]any{StorageStatusKey: r.storageStatus()} },
	}
	if node != nil {
		local := ropts.Guard
		ropts.Guard = func(current, next *config.Config) error {
			if err := local(current, next); err != nil {
				return err
			}
			if allow {
				return nil // disaster recovery overrides the cluster guard too
			}
			return node.Guard(current, next)
		}
		ropts.WriteFence, ropts.OnChange = node.WriteFence, node.Notify
		ropts.StatusExtras = func() map[string]any {
			return map[string]any{StorageStatusKey: r.storageStatus(), ClusterStatusKey: node.Status()}
		}
	}
	agent, err := reload.NewAgent(ctx, ropts)
	if err != nil {
		return nil, err
	}
	r.agent = agent
	if node != nil {
		node.Attach(agent)
	}
	return r, nil
}

// startCheckTimeout bounds the start-up check: reading the applied state and an
// inventory of Secrets and ConfigMaps by prefix (no decryption, no KMS call).
const startCheckTimeout = 2 * time.Minute

// checkStart compares the configuration on disk with the state the last applied one
// left in etcd (or in --encryption-state-file), before the server serves: a
// configuration refused on reload, or edited while the apiserver was down, must not
// be applied silently by a restart. The state key is
// migrate.AppliedStatePrefix + stateID (the apiserver identity, stable across restarts
// of the same host).
func (r *rekeyLayer) checkStart(ctx context.Context, etcd etcdConn, stateID string) error {
	if r.agent == nil {
		return nil
	}
	cli, err := newEtcdClient(etcd)
	if err != nil {
		return fmt.Errorf("encryption start-up check: %w", err)
	}
	var state migrate.AppliedStateStore = migrate.EtcdAppliedState{Client: cli, Key: migrate.AppliedStatePrefix + stateID}
	if r.opts.stateFile != "" {
		state = migrate.FileAppliedState{Path: r.opts.stateFile}
	}
	r.mu.Lock()
	r.state, r.stateClient = state, cli
	r.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, startCheckTimeout)
	defer cancel()
	agent := r.agent
	err = migrate.CheckStartup(ctx, migrate.StartupOptions{
		State:        state,
		Config:       agent.ActiveConfig(),
		Client:       cli,
		Source:       migrate.FromRules(agent, agent.Rules),
		Resources:    storageResources(r.opts.etcdPrefix),
		Transformers: agent,
		Override:     r.opts.allowDropping,
		Inventory:    r.store,
		Metrics:      r.metrics,
		Logger:       r.log,
	})
	if err != nil {
		return err
	}
	r.log.Info("Encryption configuration matches the applied state", "state", state.String(), "hash", agent.ActiveConfig().Hash)
	return nil
}

// etcdClient is the client checkStart made, or nil before it ran.
func (r *rekeyLayer) etcdClient() *clientv3.Client {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.stateClient
}

// saveApplied records cfg as applied after a reload swapped it in. A failure is logged:
// the swap is done, and the next successful save or start records the state again.
func (r *rekeyLayer) saveApplied(cfg *config.Config) {
	r.mu.Lock()
	state := r.state
	r.mu.Unlock()
	if state == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultEtcdConnectTimeout)
	defer cancel()
	if err := state.Save(ctx, migrate.NewAppliedState(cfg, r.store.Latest(), time.Now())); err != nil {
		r.log.Error(err, "Could not record the applied encryption configuration; the next start compares with the previous one", "hash", cfg.Hash)
	}
}

// ClusterStatusKey is the member of the status document that holds the cluster view
// (with --cluster-coordination).
const ClusterStatusKey = "cluster"

// startClusterNode connects to etcd, validates the coordination settings and loads the
// member list, so that the write fence knows the other apiservers before the agent
// applies its first configuration.
func startClusterNode(ctx context.Context, o *Options, reg metrics.KubeRegistry, etcd etcdConn, store *migrate.InventoryStore) (*cluster.Node, *clientv3.Client, error) {
	cli, err := newEtcdClient(etcd)
	if err != nil {
		return nil, nil, fmt.Errorf("cluster coordination: %w", err)
	}
	cm, err := cluster.NewMetrics(reg)
	if err != nil {
		_ = cli.Close()
		return nil, nil, fmt.Errorf("registering cluster metrics: %w", err)
	}
	node, err := cluster.New(cluster.Options{
		Client: cli, ID: o.APIServerID, Prefix: o.CoordinationPrefix, ResourcePrefix: o.EtcdPrefix,
		LeaseTTL: o.ClusterLeaseTTL, DisagreementAlarm: o.ClusterDisagreementAlarm,
		Inventory: store, Metrics: cm, Logger: o.Logger,
	})
	if err == nil {
		err = node.Start(ctx)
	}
	if err != nil {
		_ = cli.Close()
		return nil, nil, err
	}
	o.Logger.Info("Coordinating with the other apiservers through etcd", "apiserverID", o.APIServerID,
		"prefix", o.CoordinationPrefix, "members", len(node.View().Members()))
	return node, cli, nil
}

// storageResources are the resources the shim stores.
func storageResources(etcdPrefix string) []migrate.Resource {
	return []migrate.Resource{
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "secrets"}),
		migrate.ResourceFor(etcdPrefix, schema.GroupResource{Resource: "configmaps"}),
	}
}

func (r *rekeyLayer) startStorage(c *genericapiserver.Config, etcd etcdConn) error {
	if r.agent == nil {
		return nil
	}
	return c.AddPostStartHook(StorageMigrationHookName, func(hc genericapiserver.PostStartHookContext) error {
		cli, err := newEtcdClient(etcd)
		if err != nil {
			return fmt.Errorf("storage migration: %w", err)
		}
		agent := r.agent
		ctrl := migrate.NewController(migrate.ControllerOptions{
			Client:    cli,
			Source:    migrate.FromRules(agent, agent.Rules),
			Resources: storageResources(r.opts.etcdPrefix),
			// With coordination the elected cluster migrator migrates; this controller
			// only keeps the local inventory current.
			AutoMigrate:       r.opts.autoMigrate && r.node == nil,
			CheckInterval:     r.opts.checkInterval,
			InventoryInterval: r.opts.inventoryInterval,
			Rate:              r.opts.rate,
			ConfigHash:        func() string { return agent.ActiveConfig().Hash },
			Inventory:         r.store,
			Metrics:           r.metrics,
			Logger:            r.log,
		})
		ctx, cancel := context.WithCancel(hc.Context)
		done := make(chan struct{})
		var mig *cluster.Migrator
		if r.node != nil && r.opts.autoMigrate {
			view := r.node.View()
			mig = cluster.NewMigrator(cluster.MigratorOptions{
				Client: cli, Prefix: r.node.Prefix(), ID: r.node.ID(), SessionTTL: r.opts.leaseTTL,
				Resources: storageResources(r.opts.etcdPrefix), Source: migrate.FromRules(agent, agent.Rules),
				Inventory: r.store, Metrics: r.metrics, Rate: r.opts.rate,
				ConfigHash: func() string { return agent.ActiveConfig().Hash },
				Members:    view.Members, MembersChanged: view.Changed, Logger: r.log,
			})
			r.node.SetMigrator(mig)
		}
		r.mu.Lock()
		r.ctrl, r.migrator, r.client, r.cancel, r.done = ctrl, mig, cli, cancel, done
		r.mu.Unlock()
		go func() {
			defer close(done)
			var wg sync.WaitGroup
			if mig != nil {
				wg.Add(1)
				go func() { defer wg.Done(); mig.Run(ctx) }()
			}
			ctrl.Run(ctx)
			wg.Wait()
		}()
		r.log.Info("Started storage migration controller", "automaticMigration", r.opts.autoMigrate,
			"allowDroppingKeysInUse", r.opts.allowDropping, "etcdPrefix", r.opts.etcdPrefix)
		return nil
	})
}

// storageStatus is the storage member of the status document: the controller's state,
// or before it starts, the latest inventory alone.
func (r *rekeyLayer) storageStatus() migrate.ControllerStatus {
	r.mu.Lock()
	ctrl, mig := r.ctrl, r.migrator
	r.mu.Unlock()
	st := migrate.ControllerStatus{AutoMigrate: r.opts.autoMigrate, Inventory: r.store.Latest()}
	if ctrl != nil {
		st = ctrl.Status()
	}
	if mig != nil {
		// The elected cluster migrator migrates, not the local controller: show its work.
		st.AutoMigrate = r.opts.autoMigrate
		ms, leading := mig.State()
		st.Running = nil
		if leading && ms.Running != nil {
			st.Running = []string{ms.Running.Resource}
		}
		if last := mig.LastMigration(); last != nil {
			st.LastMigration = last
		}
	}
	return st
}

func kmsFactory(o *Options, reg metrics.KubeRegistry, node *cluster.Node) transformers.KMSFactory {
	if o.KMS != nil {
		return o.KMS
	}
	fo := kmsv2.FactoryOptions{
		Registry:       reg,
		StatusInterval: o.KMSTimings.StatusInterval,
		RetryInterval:  o.KMSTimings.RetryInterval,
		WriteTTL:       o.KMSTimings.WriteTTL,
	}
	if node != nil {
		// A new key id reaches the other apiservers at once, not at the next refresh.
		fo.OnKeyIDChange = node.NotifyKeyID
	}
	return kmsv2.NewFactory(fo)
}

func (r *rekeyLayer) install(c *genericapiserver.Config, _ *genericoptions.EtcdOptions) error {
	if r.agent == nil {
		return nil
	}
	if err := r.agent.InstallInto(c); err != nil {
		return err
	}
	if r.node != nil {
		// /readyz only: a straggler is alive, it just must not take traffic yet.
		c.AddReadyzChecks(r.node.ReadyzCheck())
	}
	return nil
}

func (r *rekeyLayer) statusPath() string {
	if r.agent == nil {
		return ""
	}
	return reload.StatusPath
}

func (r *rekeyLayer) statusHandler() http.Handler {
	if r.agent == nil {
		return nil
	}
	return r.agent.StatusHandler()
}

func (r *rekeyLayer) close() {
	r.mu.Lock()
	cancel, done, cli, stateCli := r.cancel, r.done, r.client, r.stateClient
	r.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
		_ = cli.Close()
	}
	if r.node != nil {
		r.node.Close() // revokes the member lease: the others stop counting this one
		_ = r.nodeClient.Close()
	}
	if r.agent != nil {
		r.agent.Close()
	}
	if stateCli != nil {
		_ = stateCli.Close()
	}
}
