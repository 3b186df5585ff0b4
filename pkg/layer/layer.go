// Package layer is the rekey encryption layer of an apiserver, wired once for every
// binary that embeds it (the apiserver shim and dist/kube-apiserver): the reload agent
// (transformers, kms-providers checks, reload loop, status document), the start-up check
// against the applied state, the storage inventory and migration controller, the guards
// that refuse dropping a key still in use, and — with cluster coordination — the
// cluster node (member key, write fence, rekey-cluster readiness, elected migrator).
//
// The order of calls is the apiserver's start-up order:
//
//	f := layer.NewFlags(defaults); f.AddFlags(fs)  // and after parsing, f.Validate()
//	opts := layer.Options{Flags: f, Path: ..., Etcd: ..., EtcdPrefix: ..., Identity: ...}
//	l, err := layer.New(ctx, opts)         // etcd must answer with --cluster-coordination
//	err = l.CheckStart(ctx)                // before anything is served
//	err = l.InstallInto(genericConfig, layer.Installation{Storage: etcdOptions.ApplyTo})
//	                                       // transformers, checks, storage, hooks, timing
//	mux.Handle(l.StatusPath(), l.StatusHandler())
//	defer l.Close()
//
// The layer reaches etcd through one client, made by New from Options.Etcd: the
// cluster node, the applied state, the decrypt guard, the inventory and the migration
// share it. A binary that runs etcd itself starts it before New.
package layer

import (
	"cmp"
	"context"
	"crypto/fips140"
	"errors"
	"fmt"
	"net/http"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// StorageMigrationHookName is the post-start hook that starts the storage migration
// controller (and, with coordination, the elected migrator).
const StorageMigrationHookName = "start-rekey-storage-migration"

// Members of the status document the layer adds to the agent's.
const (
	// StorageStatusKey holds the storage inventory and the migration controller's state.
	StorageStatusKey = "storage"
	// ClusterStatusKey holds the cluster view (with coordination).
	ClusterStatusKey = "cluster"
)

// StartCheckTimeout bounds the start-up check: reading the applied state and an
// inventory of the scanned resources by prefix (no decryption, no KMS call).
const StartCheckTimeout = 2 * time.Minute

// Options configure the layer: the binary's flags of the layer (Flags, read as they
// are, 0 meaning what each flag's help says), and what only the binary knows. Path
// empty makes a layer that does nothing.
type Options struct {
	Flags

	// Path is --encryption-provider-config; AutomaticReload its automatic reload.
	Path            string
	AutomaticReload bool
	// KMS builds KMS v2 providers; default kmsv2.NewFactory with the KMS flags' timings.
	KMS transformers.KMSFactory

	// Etcd is how the layer's etcd client reaches etcd: the storage backend's flags.
	// Required by New when Path is set.
	Etcd Etcd
	// Resources are scanned by the inventory, the migration and the start-up check
	// besides every resource the configuration's rules cover (found through Layout;
	// a wildcard rule's resources by a scan of what is stored under EtcdPrefix) and
	// those of Flags.StorageResources: a binary that stores a fixed set of resources
	// gives them here.
	Resources []migrate.Resource
	// EtcdPrefix is the storage backend's --etcd-prefix.
	EtcdPrefix string
	// Layout says where each resource is stored under EtcdPrefix. The distribution
	// feeds it from its storage factory as the servers build their storage; nil is
	// kube-apiserver's table of built-in resources (storagelayout.Kube). Either way
	// custom resources are added from the stored CustomResourceDefinitions.
	Layout *storagelayout.Layout

	// WatchCacheMetrics is where k8s.io/apiserver reports its watch caches'
	// revisions (apiserver_watch_cache_resource_version): its global registry,
	// legacyregistry.DefaultGatherer, which the embedding server passes. nil leaves
	// the watch cache out of the pacing (Flags.StorageMigrationMaxWatchLag).
	WatchCacheMetrics prometheus.Gatherer

	// Identity is k8s.io/apiserver's identity of this apiserver (Config.APIServerID):
	// the apiserver_id label of the agent's metrics, and the default of
	// Flags.APIServerID (the member key) and Flags.EncryptionStateID.
	Identity string

	// MigrationMirror, with coordination and storage migration, is told of each
	// migration the elected migrator runs (dist/kube-apiserver mirrors them as
	// StorageVersionMigrations); nil for none.
	MigrationMirror cluster.MigrationMirror

	// FIPS makes the layer refuse, at start-up and on every reload, a configuration
	// naming a provider outside FIPS 140-3's approved set (transformers.FIPSRefusal).
	// The layer also does when the process runs in FIPS mode (crypto/fips140.Enabled,
	// GODEBUG=fips140=on or only), whatever this says: tests set it to judge as FIPS mode.
	FIPS bool

	// Registry receives the layer's metrics; Logger its logs.
	Registry metrics.KubeRegistry
	Logger   klog.Logger
}

// fipsMode is the process's FIPS 140-3 mode, at least FIPSOn when Options.FIPS says so.
func (o *Options) fipsMode() transformers.FIPSMode {
	mode := transformers.FIPSModeOf(fips140.Enabled(), fips140.Enforced())
	if o.FIPS && mode == transformers.FIPSOff {
		mode = transformers.FIPSOn
	}
	return mode
}

// Validate checks what can be checked before etcd is reached (and before an embedded
// etcd's address is known): the flags against the binary's part (--etcd-prefix, the
// default --apiserver-id, where the named resources are stored).
func (o *Options) Validate() error {
	if o.Path == "" {
		return nil
	}
	if _, err := o.resources(); err != nil {
		return err
	}
	if !o.ClusterCoordination && o.EtcdPrefix == "" {
		return nil
	}
	// The applied state lives under the coordination prefix with or without coordination.
	if err := coordination.ValidatePrefix(o.coordinationPrefix(), o.EtcdPrefix); err != nil {
		return err
	}
	if !o.ClusterCoordination {
		return nil
	}
	return coordination.ValidateID(o.memberID())
}

// layout is Layout or kube-apiserver's table under EtcdPrefix.
func (o *Options) layout() *storagelayout.Layout {
	if o.Layout == nil {
		o.Layout = storagelayout.Kube(o.EtcdPrefix)
	}
	return o.Layout
}

// coordinationPrefix is CoordinationPrefix or its default.
func (o *Options) coordinationPrefix() string {
	return cmp.Or(o.CoordinationPrefix, DefaultCoordinationPrefix(o.EtcdPrefix))
}

// memberID is this apiserver's name among those sharing etcd (its member key):
// --apiserver-id, or the binary's identity.
func (o *Options) memberID() string { return cmp.Or(o.APIServerID, o.Identity) }

// stateID names the applied state in etcd (key coordination.AppliedState under the
// coordination prefix, read from guard.AppliedStatePrefix + it when absent):
// --encryption-state-id, or the binary's identity; stable across restarts of the same
// apiserver.
func (o *Options) stateID() string { return cmp.Or(o.EncryptionStateID, o.Identity) }

// resources are Resources and those Flags.StorageResources names, where Layout stores
// them.
func (o *Options) resources() ([]migrate.Resource, error) {
	out := slices.Clone(o.Resources)
	layout := o.Layout
	if layout == nil {
		layout = storagelayout.Kube(o.EtcdPrefix)
	}
	for _, s := range o.StorageResources {
		r, err := migrate.ParseResource(layout, s)
		if err != nil {
			return nil, fmt.Errorf("--%s: %w", FlagStorageMigrationResources, err)
		}
		out = append(out, r)
	}
	return out, nil
}

// space bounds how full migrations let etcd's database get.
func (o *Options) space() pace.SpaceOptions {
	return pace.SpaceOptions{QuotaBytes: o.StorageMigrationEtcdQuotaBytes, MaxFraction: o.StorageMigrationMaxDBFraction}
}

// CheckFile reads and validates the configuration file as New will, without building
// transformers or reaching etcd or a KMS plugin: a binary that starts etcd itself
// reports a malformed file before that.
func (o *Options) CheckFile() error {
	if o.Path == "" {
		return nil
	}
	_, err := config.Load(o.Path, config.Options{Reload: o.AutomaticReload})
	return err
}

// Layer is the rekey encryption layer of one apiserver.
type Layer struct {
	opts    Options
	agent   *reload.Agent
	store   *migrate.InventoryStore
	metrics *migrate.Metrics
	// refusals counts every guard's refusals, the cluster guard's included.
	refusals *guard.Metrics
	log      klog.Logger
	// events holds the layer's events until the events hook's recorder takes them.
	events *events.Deferred
	keyIDs *kmsKeyIDs
	// superseded is the key ledger's superseded KMS v2 key ids per provider name, as
	// the ledger recorder last read it (nil before); the providers refuse them.
	superseded atomic.Pointer[map[string][]string]
	// ledgerWake asks the ledger recorder to record now (a KMS provider writes under a
	// new key id).
	ledgerWake chan struct{}
	// serving is how fast the apiserver answers its clients (AddServingLatency feeds
	// it); migrations slow down when they slow it.
	serving *pace.ServingLatency
	// watchCache reads how far the apiserver's watch caches have got (nil: not known).
	watchCache *watchCacheRevisions
	// probeMetrics are the KMS decrypt probe's (nil: it never runs).
	probeMetrics *kmsProbeMetrics

	// client is the layer's one etcd client, closed last.
	client *clientv3.Client
	// node coordinates with the other apiservers (nil without Cluster).
	node *cluster.Node

	closeOnce sync.Once

	mu sync.Mutex
	// state persists what the applied configuration can read (CheckStart sets it).
	state    guard.AppliedStateStore
	ctrl     *migrate.Controller
	migrator *cluster.Migrator
	// statePublisher stores the EncryptionState (nil: none); stateKeeper keeps it
	// current once the storage hook runs.
	statePublisher encryptionstate.Publisher
	stateKeeper    *encryptionstate.Keeper
	// ledger is the key ledger as the recorder last read it (nil before): it names
	// retired keys in the EncryptionState.
	ledger atomic.Pointer[keyledger.Ledger]
	cancel context.CancelFunc
	done   chan struct{}
}

// pacing is how migrations adapt their rate: to etcd, and with the clients' latency
// timed (AddServingLatency) to them too.
func (l *Layer) pacing() pace.Options {
	// The flag's 0 leaves the watch cache out; pace's 0 is its default.
	factor, priority := l.opts.Pacing()
	p := pace.Options{Serving: l.serving, ServingFactor: factor, Priority: priority, MaxWatchLag: noBoundIfZero(l.opts.StorageMigrationMaxWatchLag)}
	if l.watchCache != nil {
		p.WatchCache = l.watchCache.Revision
	}
	return p
}

// resolver finds the stored resources a configuration's rules cover: through the
// layout, plus Options.Resources; the coordination prefix holds none.
func (l *Layer) resolver() *migrate.Resolver {
	return &migrate.Resolver{Client: l.client, Layout: l.opts.layout(), Skip: []string{l.opts.coordinationPrefix()}, Extra: l.opts.Resources}
}

// New makes the layer's etcd client, builds the layer and loads the configuration.
// With Cluster it first loads the member list from etcd, so that the write fence knows
// the other apiservers before the agent applies its first configuration.
func New(ctx context.Context, o Options) (_ *Layer, err error) {
	if o.Path == "" {
		return &Layer{opts: o}, nil
	}
	if o.Logger.GetSink() == nil {
		o.Logger = klog.Background()
	}
	if o.Registry == nil {
		o.Registry = metrics.NewKubeRegistry()
	}
	if err := o.Validate(); err != nil {
		return nil, err
	}
	o.CoordinationPrefix = o.coordinationPrefix()
	if o.Resources, err = o.resources(); err != nil {
		return nil, err
	}
	o.StorageResources = nil // in Resources now
	if len(o.Etcd.Servers) == 0 {
		return nil, errors.New("the encryption layer needs the storage backend's etcd servers (--etcd-servers) to keep its state and inventories")
	}
	m, err := migrate.NewMetrics(o.Registry)
	if err != nil {
		return nil, fmt.Errorf("registering storage migration metrics: %w", err)
	}
	refusals, err := guard.NewMetrics(o.Registry)
	if err != nil {
		return nil, fmt.Errorf("registering guard metrics: %w", err)
	}
	cli, err := o.Etcd.NewClient()
	if err != nil {
		return nil, fmt.Errorf("encryption layer: %w", err)
	}
	o.layout() // set once, before any goroutine reads the options
	l := &Layer{opts: o, client: cli, store: &migrate.InventoryStore{}, metrics: m, refusals: refusals, log: o.Logger, events: &events.Deferred{}}
	if o.KMSDecryptProbeInterval > 0 {
		if l.probeMetrics, err = newKMSProbeMetrics(o.Registry); err != nil {
			_ = cli.Close()
			return nil, fmt.Errorf("registering KMS decrypt probe metrics: %w", err)
		}
	}
	if o.StorageMigrationClientLatencyFactor > 0 {
		l.serving = pace.NewServingLatency(nil)
	}
	if o.WatchCacheMetrics != nil && o.StorageMigrationMaxWatchLag > 0 {
		l.watchCache = newWatchCacheRevisions(o.WatchCacheMetrics, nil)
	}
	l.keyIDs = &kmsKeyIDs{sink: l.events}
	l.ledgerWake = make(chan struct{}, 1)
	defer func() {
		if err != nil {
			if l.node != nil {
				l.node.Close()
			}
			_ = cli.Close()
		}
	}()
	if o.ClusterCoordination {
		if err := l.startClusterNode(ctx); err != nil {
			return nil, err
		}
	}
	// The KMS v2 providers the agent builds refuse a key id the key ledger shows
	// superseded from their first Status on: read it before they exist.
	l.loadSuperseded(ctx)
	var running runningRules
	agent, err := reload.NewAgent(ctx, l.agentOptions(&running))
	if err != nil {
		return nil, err
	}
	running.agent.Store(agent)
	l.agent = agent
	if l.node != nil {
		l.node.Attach(agent)
	}
	return l, nil
}

// agentOptions wires the reload agent: the local guards, and with a cluster node its
// guard, write fence and status. running receives the agent once it exists.
func (l *Layer) agentOptions(running *runningRules) reload.Options {
	o := l.opts
	allow := o.AllowDroppingKeysInUse
	ropts := reload.Options{
		Path:            o.Path,
		AutomaticReload: o.AutomaticReload,
		PollInterval:    o.ReloadPollInterval,
		Transformers: transformers.Options{
			Logger:  o.Logger,
			Metrics: transformers.NewMetrics(o.Registry),
			KMS:     l.kmsFactory(),
			// The process's FIPS 140-3 mode, read here at the edge; the rule
			// (transformers.FIPSRefusal) takes it as an option.
			FIPS: o.fipsMode(),
		},
		Registry:    o.Registry,
		APIServerID: o.Identity,
		Logger:      o.Logger,
		// The guard judges against what the agent writes with now (a write fence may
		// hold the configuration's first key back), once the agent exists.
		Guard: guard.New(l.store, func() bool { return allow }, running.rules, l.refusals, o.Logger),
		SetGuard: guard.NewDecrypt(guard.DecryptOptions{
			Inventory: l.store,
			Client:    l.etcdClient,
			Override:  func() bool { return allow },
			Metrics:   l.refusals,
			Logger:    o.Logger,
		}),
		Applied:      l.saveApplied,
		StatusExtras: func() map[string]any { return map[string]any{StorageStatusKey: l.storageStatus()} },
	}
	if o.BackupRetention > 0 {
		inUse, retention := ropts.Guard, guard.NewRetention(l.retentionOptions())
		ropts.Guard = func(current, next *config.Config) error {
			if err := inUse(current, next); err != nil {
				return err
			}
			return retention(current, next)
		}
	}
	if node := l.node; node != nil {
		local := ropts.Guard
		ropts.Guard = func(current, next *config.Config) error {
			if err := local(current, next); err != nil {
				return err
			}
			if allow {
				return nil // disaster recovery overrides the cluster guard too
			}
			return l.refusals.Count(node.Guard(current, next))
		}
		ropts.WriteFence, ropts.OnChange, ropts.WriteGate = node.WriteFence, node.Notify, node.WriteGate
		ropts.StatusExtras = func() map[string]any {
			return map[string]any{StorageStatusKey: l.storageStatus(), ClusterStatusKey: node.Status()}
		}
	}
	ropts.Events = l.events
	judge, judgeSet := ropts.Guard, ropts.SetGuard
	ropts.Guard = func(current, next *config.Config) error { return l.reportRefusal(judge(current, next)) }
	ropts.SetGuard = func(ctx context.Context, current, next *config.Config, set *transformers.Set) error {
		return l.reportRefusal(judgeSet(ctx, current, next, set))
	}
	return ropts
}

// Active reports whether the layer encrypts (a configuration file is set).
func (l *Layer) Active() bool { return l.agent != nil }

// Agent is the reload agent, or nil when the layer is not active.
func (l *Layer) Agent() *reload.Agent { return l.agent }

func (l *Layer) startClusterNode(ctx context.Context) error {
	o := l.opts
	cm, err := cluster.NewMetrics(o.Registry)
	if err != nil {
		return fmt.Errorf("registering cluster metrics: %w", err)
	}
	node, err := cluster.New(cluster.Options{
		Client: l.client, ID: o.memberID(), Prefix: o.CoordinationPrefix, ResourcePrefix: o.EtcdPrefix,
		LeaseTTL: o.ClusterLeaseTTL, DisagreementAlarm: o.ClusterDisagreementAlarm,
		MigratesResources: migratedResources(o), BackupRetention: o.BackupRetention,
		Inventory: l.store, Metrics: cm, Logger: o.Logger, Events: l.events,
	})
	if err == nil {
		err = node.Start(ctx)
	}
	if err != nil {
		return err
	}
	o.Logger.Info("Coordinating with the other apiservers through etcd", "apiserverID", o.memberID(),
		"prefix", o.CoordinationPrefix, "members", len(node.Members()))
	l.node = node
	return nil
}

// migratedResources names what this apiserver migrates as the elected migration leader
// (its Migrator's resources; none with --storage-migration off), for its member record.
func migratedResources(o Options) []string {
	if !o.StorageMigration {
		return nil
	}
	// Every resource the configuration's rules cover is migrated (the resolver finds
	// them at each check, whatever the rules become), so the record says "*.*", then
	// the resources named besides the rules.
	names := []string{"*.*"}
	for _, r := range o.Resources {
		names = append(names, r.String())
	}
	return names
}

func (l *Layer) kmsFactory() transformers.KMSFactory {
	if l.opts.KMS != nil {
		return l.opts.KMS
	}
	fo := kmsv2.FactoryOptions{
		Registry:       l.opts.Registry,
		StatusInterval: l.opts.KMSStatusInterval,
		RetryInterval:  l.opts.KMSRetryInterval,
		WriteTTL:       l.opts.KMSWriteTTL,
		// A flag's 0 is "no bound"; kmsv2's 0 is its default.
		SeedMaxAge:    noBoundIfZero(l.opts.KMSSeedMaxAge),
		SeedMaxWrites: noBoundIfZero(l.opts.KMSSeedMaxWrites),
		DEKCacheIdle:  noBoundIfZero(l.opts.KMSDEKCacheIdle),
		// A flap shorter than the confirmations rewrites nothing; a key id the ledger
		// shows superseded is refused as a write key (docs/kms-plugin.md).
		KeyIDConfirmations: l.opts.KMSKeyIDConfirmations,
		SupersededKeyIDs:   l.supersededKeyIDs,
		Events:             l.events,
	}
	fo.OnKeyIDChange = func(provider, keyIDHash string) {
		l.keyIDs.seen(provider, keyIDHash)
		l.wakeLedger()
	}
	if node := l.node; node != nil {
		// A new key id reaches the other apiservers at once, not at the next refresh, and
		// is written under only once every apiserver's plugin reports it.
		fo.OnKeyIDChange = func(provider, keyIDHash string) {
			l.keyIDs.seen(provider, keyIDHash)
			l.wakeLedger()
			node.NotifyKeyID(provider, keyIDHash)
		}
		fo.MayWriteKeyID = l.node.MayWriteKeyID
		fo.FirstSeedHold = l.opts.KMSFirstSeedHold
	}
	return kmsv2.NewFactory(fo)
}

// CheckStart compares the configuration on disk with the state the last applied one
// left in etcd (key coordination.AppliedState under the coordination prefix, or where an
// older version kept it, guard.AppliedStatePrefix + the state id) or in
// --encryption-state-file, before the server serves: a configuration refused on reload, or
// edited while the apiserver was down, must not be applied silently by a restart.
func (l *Layer) CheckStart(ctx context.Context) error {
	if l.agent == nil {
		return nil
	}
	stateID := l.opts.stateID()
	if stateID == "" && l.opts.EncryptionStateFile == "" {
		return errors.New("encryption start-up check: no state id for the applied state in etcd (--encryption-state-id, or the apiserver's identity)")
	}
	var state guard.AppliedStateStore = guard.EtcdAppliedState{Client: l.client,
		Key: coordination.AppliedState(l.opts.CoordinationPrefix, stateID), Fallback: guard.AppliedStatePrefix + stateID}
	if l.opts.EncryptionStateFile != "" {
		state = guard.FileAppliedState{Path: l.opts.EncryptionStateFile}
	}
	l.mu.Lock()
	l.state = state
	l.mu.Unlock()
	ctx, cancel := context.WithTimeout(ctx, StartCheckTimeout)
	defer cancel()
	agent := l.agent
	err := guard.CheckStartup(ctx, guard.StartupOptions{
		State:        state,
		Config:       agent.ActiveConfig(),
		Client:       l.client,
		Source:       migrate.FromRules(agent, agent.Rules),
		Resolve:      l.resolver().Resolve,
		Transformers: agent,
		Override:     l.opts.AllowDroppingKeysInUse,
		Inventory:    l.store,
		Retention:    l.retentionOptions(),
		Metrics:      l.metrics,
		Refusals:     l.refusals,
		Logger:       l.log,
	})
	if err != nil {
		return err
	}
	l.log.Info("Encryption configuration matches the applied state", "state", state.String(), "hash", agent.ActiveConfig().Hash)
	return nil
}

// etcdClient is the layer's etcd client, for the decrypt guard.
func (l *Layer) etcdClient() *clientv3.Client { return l.client }

// saveApplied records cfg as applied after a reload swapped it in. A failure is logged:
// the swap is done, and the next successful save or start records the state again.
func (l *Layer) saveApplied(cfg *config.Config) {
	l.mu.Lock()
	state := l.state
	l.mu.Unlock()
	if state == nil {
		return
	}
	ctx, cancel := context.WithTimeout(context.Background(), DefaultEtcdDialTimeout)
	defer cancel()
	if err := state.Save(ctx, guard.NewAppliedState(cfg, l.store.Latest(), time.Now())); err != nil {
		l.log.Error(err, "Could not record the applied encryption configuration; the next start compares with the previous one", "hash", cfg.Hash)
	}
}

// Installation is what InstallInto needs from the binary besides the server config.
type Installation struct {
	// Storage sets c.RESTOptionsGetter on c.ResourceTransformers, which InstallInto has
	// made the layer's: the binary's etcd options (genericoptions.EtcdOptions.ApplyTo),
	// or kube-apiserver's rebuild on its storage factory. Required.
	Storage func(c *genericapiserver.Config) error
	// EventsAbout is what the layer's core/v1 Events are about (APIServerLease in the
	// distribution). nil posts none: the apiserver shim serves no Events, and every
	// event's fact is in the layer's log too.
	EventsAbout *corev1.ObjectReference
	// ClientsServedElsewhere says that c's handler chain never answers the clients
	// (kube-apiserver: the aggregator's does, whose config is made from c later): the
	// binary then calls AddServingLatency on that config instead.
	ClientsServedElsewhere bool
}

// InstallInto puts the layer into the server config c, for every binary in the same
// order: the agent becomes c.ResourceTransformers with its checks and reload hook
// (install), in.Storage builds the storage on it, the events hook posts the layer's
// Events (with in.EventsAbout), the storage hook answers refused writes with 503 and
// starts the inventory and migration after start (addStorageHook), and the handler
// chain times the clients' requests for the migration's pacing (AddServingLatency,
// unless in.ClientsServedElsewhere). A layer that is not active leaves c's transformers
// alone and only calls in.Storage.
func (l *Layer) InstallInto(c *genericapiserver.Config, in Installation) error {
	if in.Storage == nil {
		return errors.New("encryption layer: Installation.Storage is required: it builds the storage on the layer's transformers")
	}
	if err := l.install(c); err != nil {
		return err
	}
	if !in.ClientsServedElsewhere {
		l.AddServingLatency(c)
	}
	if err := in.Storage(c); err != nil {
		return err
	}
	if in.EventsAbout != nil {
		if err := l.addEventsHook(c, in.EventsAbout); err != nil {
			return err
		}
	}
	return l.addStorageHook(c)
}

// install makes the agent c.ResourceTransformers with its kms-providers checks and the
// reload post-start hook, and adds the rekey-cluster check to /readyz with coordination.
func (l *Layer) install(c *genericapiserver.Config) error {
	if l.agent == nil {
		return nil
	}
	if err := l.agent.InstallInto(c); err != nil {
		return err
	}
	if l.node != nil {
		// /readyz only: a straggler is alive, it just must not take traffic yet.
		c.AddReadyzChecks(l.node.ReadyzCheck())
	}
	return nil
}

// addStorageHook starts, after the server has started, the migration controller (the
// inventory, and the migration itself unless coordination elects a migrator instead)
// and with coordination the elected cluster migrator; both stop with the server. It
// also makes the storage of c.RESTOptionsGetter (WithRefusedWrites) answer a write the
// write fence refuses with 503 and the refusal's message, so it is called once the
// etcd options have set that getter.
func (l *Layer) addStorageHook(c *genericapiserver.Config) error {
	if l.agent == nil {
		return nil
	}
	if c.RESTOptionsGetter == nil {
		return errors.New("encryption layer: the storage hook needs the REST options getter; apply the etcd options to the server config first")
	}
	c.RESTOptionsGetter = WithRefusedWrites(c.RESTOptionsGetter)
	return c.AddPostStartHook(StorageMigrationHookName, func(hc genericapiserver.PostStartHookContext) error {
		cli, agent, o := l.client, l.agent, l.opts
		resolver := l.resolver()
		// Set before the controller runs (below); nil without coordination.
		var mig *cluster.Migrator
		ctrl := migrate.NewController(migrate.ControllerOptions{
			Client: cli,
			Source: migrate.FromRules(agent, agent.Rules),
			Resolve: func(ctx context.Context) (migrate.Resolution, error) {
				return resolver.Resolve(ctx, ruleNames(agent.Rules()))
			},
			// With coordination the elected cluster migrator migrates; this controller
			// only keeps the local inventory current.
			AutoMigrate: o.StorageMigration && l.node == nil,
			// The elected migrator's verifying re-scan becomes this inventory.
			InventoriedElsewhere: func(resource, prefix, keyIDHash string) bool {
				return mig != nil && mig.InventoriesTo(resource, prefix, keyIDHash)
			},
			CheckInterval:     o.StorageCheckInterval,
			InventoryInterval: o.StorageInventoryInterval,
			Rate:              o.StorageMigrationRate,
			Space:             o.space(),
			Pacing:            l.pacing(),
			ConfigHash:        func() string { return agent.ActiveConfig().Hash },
			// Operators acknowledge unreadable objects there (rekey migrate
			// --acknowledge-unreadable); the inventory counts them apart.
			CoordinationPrefix: o.coordinationPrefix(),
			Inventory:          l.store,
			Metrics:            l.metrics,
			Logger:             l.log,
		})
		ctx, cancel := context.WithCancel(hc.Context)
		done := make(chan struct{})
		if l.node != nil && o.StorageMigration {
			mig = cluster.NewMigrator(cluster.MigratorOptions{
				Client: cli, Prefix: l.node.Prefix(), ID: l.node.ID(), SessionTTL: o.ClusterLeaseTTL,
				CurrentResources: ctrl.Resources, Source: migrate.FromRules(agent, agent.Rules),
				Inventory: l.store, Metrics: l.metrics, Rate: o.StorageMigrationRate, Space: o.space(),
				Pacing: l.pacing(), ConfigHash: func() string { return agent.ActiveConfig().Hash },
				Members: l.node.Members, MembersChanged: l.node.MembersChanged, Logger: l.log,
				Events: l.events, Mirror: o.MigrationMirror,
			})
			l.node.SetMigrator(mig)
		}
		keeper := l.newStateKeeper(mig)
		l.mu.Lock()
		l.ctrl, l.migrator, l.cancel, l.done, l.stateKeeper = ctrl, mig, cancel, done, keeper
		l.mu.Unlock()
		go func() {
			defer close(done)
			var wg sync.WaitGroup
			if mig != nil {
				wg.Add(1)
				go func() { defer wg.Done(); mig.Run(ctx) }()
			}
			wg.Add(1)
			go func() { defer wg.Done(); l.ledgerRecorder().Run(ctx, ledgerRecordInterval) }()
			if keeper != nil {
				wg.Add(1)
				go func() { defer wg.Done(); keeper.Run(ctx) }()
			}
			if l.probeMetrics != nil {
				probe := &kmsProbe{inventory: l.store, client: l.etcdClient, config: agent.ActiveConfig, tr: agent,
					events: l.events, log: l.log.WithName("kms-decrypt-probe"), m: l.probeMetrics}
				wg.Add(1)
				go func() { defer wg.Done(); probe.Run(ctx, o.KMSDecryptProbeInterval) }()
			}
			ctrl.Run(ctx)
			wg.Wait()
		}()
		l.log.Info("Started storage migration controller", "automaticMigration", o.StorageMigration,
			"allowDroppingKeysInUse", o.AllowDroppingKeysInUse, "etcdPrefix", o.EtcdPrefix, "resources", len(o.Resources))
		return nil
	})
}

// storageStatus is the storage member of the status document: the controller's state,
// or before it starts, the latest inventory alone.
func (l *Layer) storageStatus() migrate.ControllerStatus {
	l.mu.Lock()
	ctrl, mig := l.ctrl, l.migrator
	l.mu.Unlock()
	st := migrate.ControllerStatus{AutoMigrate: l.opts.StorageMigration, Inventory: l.store.Latest()}
	if ctrl != nil {
		st = ctrl.Status()
	}
	if mig != nil {
		// The elected cluster migrator migrates, not the local controller: show its work.
		st.AutoMigrate = l.opts.StorageMigration
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

// StatusPath is where StatusHandler belongs ("" when the layer is not active).
func (l *Layer) StatusPath() string {
	if l.agent == nil {
		return ""
	}
	return reload.StatusPath
}

// StatusHandler serves the status document (nil when the layer is not active).
func (l *Layer) StatusHandler() http.Handler {
	if l.agent == nil {
		return nil
	}
	return l.agent.StatusHandler()
}

// Close stops the controllers, revokes the member lease and closes the agent and the
// etcd client. It may be called more than once.
func (l *Layer) Close() { l.closeOnce.Do(l.close) }

func (l *Layer) close() {
	l.mu.Lock()
	cancel, done := l.cancel, l.done
	l.mu.Unlock()
	if cancel != nil {
		cancel()
		<-done
	}
	if l.node != nil {
		l.node.Close() // revokes the member lease: the others stop counting this one
	}
	if l.agent != nil {
		l.agent.Close()
	}
	// Last: the node's lease revocation and a reload's saveApplied use it.
	if l.client != nil {
		_ = l.client.Close()
	}
}

// runningRules gives the key-in-use guard the rules the agent serves, once NewAgent has
// returned it (the guard is built before the agent; the first load judges nothing).
type runningRules struct{ agent atomic.Pointer[reload.Agent] }

func (r *runningRules) rules() []transformers.RuleInfo {
	if a := r.agent.Load(); a != nil {
		return a.Rules()
	}
	return nil
}

// ruleNames lists the resource names of rules, in order: what a Resolver resolves.
func ruleNames(rules []transformers.RuleInfo) []string {
	out := make([]string, 0, len(rules))
	for _, r := range rules {
		out = append(out, r.Resource)
	}
	return out
}

// noBoundIfZero maps a flag's 0 (no bound, or off) to what the options of pkg/migrate/pace
// and pkg/transformers/kmsv2 call no bound (negative; their 0 is their default).
func noBoundIfZero[T time.Duration | int64](v T) T {
	if v == 0 {
		return -1
	}
	return v
}
