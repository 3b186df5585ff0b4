package layer

import (
	"fmt"
	"path"
	"strconv"
	"strings"
	"time"

	"github.com/spf13/pflag"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/migrate/pace"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// Encryption layers a binary can run with (--encryption-layer).
const (
	// EncryptionLayerRekey is this package: rekey's agent, storage migration and
	// cluster coordination.
	EncryptionLayerRekey = "rekey"
	// EncryptionLayerUpstream is k8s.io/apiserver's own encryptionconfig, wired as
	// kube-apiserver wires it, kept for side-by-side comparisons; the binary then does
	// not build this layer at all.
	EncryptionLayerUpstream = "upstream"
)

// DefaultKMSStatusInterval is --kms-status-interval's default: shorter than
// kube-apiserver's minute so that a plugin's new key id reaches the write fence and the
// migrator quickly.
const DefaultKMSStatusInterval = 15 * time.Second

// DefaultKMSDecryptProbeInterval is --kms-decrypt-probe-interval's default: one plugin
// Decrypt per KMS v2 key id in use every 5 minutes, well inside any DEK cache's life.
const DefaultKMSDecryptProbeInterval = 5 * time.Minute

// DefaultKMSFirstSeedHold is --kms-first-seed-hold's default: two Status intervals, so a
// plugin on another node that rotated its key with this one's is seen and published,
// while a plugin that lags for longer does not keep this apiserver from writing.
const DefaultKMSFirstSeedHold = 2 * DefaultKMSStatusInterval

// Names of the flags whose default differs between the binaries (see Defaults).
const (
	FlagStorageMigration          = "storage-migration"
	FlagStorageMigrationResources = "storage-migration-resources"
	FlagAPIServerID               = "apiserver-id"
)

// Names of the flags of the trade between a migration's speed and the clients' latency.
const (
	FlagStorageMigrationPriority            = "storage-migration-priority"
	FlagStorageMigrationClientLatencyFactor = "storage-migration-client-latency-factor"
)

// Defaults are what may differ between the binaries that embed the layer; everything
// else about the layer's flags (names, types, help, hidden-ness, other defaults) is the
// same in all of them. Each binary's choice is a function below with its reason.
type Defaults struct {
	// StorageMigration is --storage-migration's default.
	StorageMigration bool
	// StorageResources is --storage-migration-resources' default. Nil: the binary
	// stores a fixed set of resources, which it gives as Options.Resources, and does not
	// offer the flag.
	StorageResources []string
	// APIServerIDDefault says in --apiserver-id's help what the binary calls itself
	// without the flag (the binary computes it; see Options.APIServerID).
	APIServerIDDefault string
}

// ShimDefaults are cmd/apiserver-shim's.
func ShimDefaults() Defaults {
	return Defaults{
		// The shim exists to show and test rekey end to end: stored data follows the
		// keys unless asked not to.
		StorageMigration: true,
		// The shim serves exactly Secrets and ConfigMaps; scanning anything else would
		// count 0 objects at a prefix nothing is stored under, which proves nothing.
		StorageResources: nil,
		// Several shims commonly share one host (the testbed, the benchmarks): the port
		// keeps their member keys apart without flags.
		APIServerIDDefault: "<hostname>:<secure-port>; with --secure-port 0, <hostname>-<random>",
	}
}

// KubeAPIServerDefaults are dist/kube-apiserver's.
func KubeAPIServerDefaults() Defaults {
	return Defaults{
		// On, as in the shim: with cluster coordination one elected leader migrates,
		// with compare-and-swap, and only once every live member writes with the same
		// key; the others only take inventories. Off, a rotation's stored data never
		// moves and `rekey rotate --wait` refuses to start one. While upstream
		// kube-apiservers still share the etcd (a rollout), they do not take part in the
		// fence: turn it off until every node runs this build (docs/kube-apiserver.md).
		StorageMigration: true,
		// Nothing beyond the configuration's rules: every resource a rule names is
		// scanned where the storage factory stores it, and a wildcard rule's resources
		// are found in etcd. The flag adds resources a rule does not name.
		StorageResources: []string{},
		// kube-apiserver's own identity: the name of its Lease in kube-system, which
		// operators already see.
		APIServerIDDefault: "kube-apiserver's own identity, apiserver-<hash of the host name>, the name of its Lease in kube-system",
	}
}

// Flags are the layer's command-line flags. Every binary that embeds the layer declares
// them with AddFlags, checks them with Validate and hands them to the layer as
// Options.Flags, which the layer reads as they are (each field means what its flag's
// help says), so the binaries cannot drift. Flags that are not the layer's
// (--encryption-provider-config and its reload flag, --etcd-*, serving, authentication)
// stay with the binary: kube-apiserver has its own, and the layer takes their values
// as Options.
//
// The zero value is usable for in-process callers: zero durations keep the defaults of
// pkg/reload, pkg/migrate, pkg/cluster and pkg/transformers/kmsv2 (but see the KMS seed
// bounds and the watch lag), an empty EncryptionLayer means rekey, and coordination is
// off.
type Flags struct {
	// EncryptionLayer is EncryptionLayerRekey or EncryptionLayerUpstream.
	EncryptionLayer    string
	ReloadPollInterval time.Duration

	KMSStatusInterval time.Duration
	KMSRetryInterval  time.Duration
	KMSWriteTTL       time.Duration
	KMSFirstSeedHold  time.Duration
	// KMSSeedMaxAge, KMSSeedMaxWrites and KMSDEKCacheIdle: 0 means no bound (the
	// flags' own meaning of 0), unlike the other durations here.
	KMSSeedMaxAge    time.Duration
	KMSSeedMaxWrites int64
	KMSDEKCacheIdle  time.Duration
	// KMSKeyIDConfirmations is --kms-key-id-confirmations; 0 keeps the default.
	KMSKeyIDConfirmations int
	// KMSDecryptProbeInterval is --kms-decrypt-probe-interval: how often one stored
	// object per KMS v2 provider and key id is decrypted by the plugin, past every DEK
	// cache; 0 probes never.
	KMSDecryptProbeInterval time.Duration

	StorageMigration     bool
	StorageMigrationRate float64
	// StorageMigrationClientLatencyFactor: migrations slow down while the apiserver
	// answers its clients more than this many times slower than before (p99; see
	// pace.Options.ServingFactor); 0 leaves the clients' latency out.
	// StorageMigrationMaxWatchLag: migrations slow down while the apiserver's watch
	// cache of the resource is further behind their writes than this (needs
	// Options.WatchCacheMetrics); 0 or negative leaves the watch cache out.
	StorageMigrationClientLatencyFactor float64
	StorageMigrationMaxWatchLag         time.Duration
	// StorageMigrationPriority is --storage-migration-priority (pace.Priority's
	// names; "" is normal): the clients' latency factor unless
	// StorageMigrationClientLatencyFactor was set (see ServingFactor), and where a
	// migration starts.
	StorageMigrationPriority string
	// clientLatencyFactorSet: --storage-migration-client-latency-factor was given on
	// the command line (AddFlags' value records it), so it wins over the priority even
	// at its default value.
	clientLatencyFactorSet bool
	// StorageMigrationEtcdQuotaBytes and StorageMigrationMaxDBFraction: see
	// pace.SpaceOptions.
	StorageMigrationEtcdQuotaBytes int64
	StorageMigrationMaxDBFraction  float64
	StorageResources               []string
	StorageCheckInterval           time.Duration
	StorageInventoryInterval       time.Duration
	AllowDroppingKeysInUse         bool
	// BackupRetention is --backup-retention (guard.BackupRetentionFlag); 0 is off.
	BackupRetention     time.Duration
	EncryptionStateFile string
	EncryptionStateID   string

	APIServerID              string
	ClusterCoordination      bool
	CoordinationPrefix       string
	ClusterLeaseTTL          time.Duration
	ClusterDisagreementAlarm time.Duration

	defaults Defaults
}

// NewFlags returns the flags with their defaults, d being the binary's.
func NewFlags(d Defaults) Flags {
	return Flags{
		EncryptionLayer:                     EncryptionLayerRekey,
		KMSStatusInterval:                   DefaultKMSStatusInterval,
		KMSFirstSeedHold:                    DefaultKMSFirstSeedHold,
		KMSSeedMaxAge:                       kmsv2.DefaultSeedMaxAge,
		KMSSeedMaxWrites:                    kmsv2.DefaultSeedMaxWrites,
		KMSDEKCacheIdle:                     kmsv2.DefaultDEKCacheIdle,
		KMSKeyIDConfirmations:               kmsv2.DefaultKeyIDConfirmations,
		KMSDecryptProbeInterval:             DefaultKMSDecryptProbeInterval,
		StorageMigration:                    d.StorageMigration,
		StorageMigrationEtcdQuotaBytes:      pace.DefaultEtcdQuotaBytes,
		StorageMigrationMaxDBFraction:       pace.DefaultMaxDBFraction,
		StorageMigrationClientLatencyFactor: pace.DefaultServingFactor,
		StorageMigrationMaxWatchLag:         pace.DefaultMaxWatchLag,
		StorageMigrationPriority:            string(pace.PriorityNormal),
		StorageResources:                    d.StorageResources,
		ClusterCoordination:                 true,
		ClusterLeaseTTL:                     cluster.DefaultLeaseTTL,
		ClusterDisagreementAlarm:            cluster.DefaultDisagreementAlarm,
		defaults:                            d,
	}
}

// AddFlags declares every flag of the layer in fs, with the current values as defaults.
func (f *Flags) AddFlags(fs *pflag.FlagSet) {
	fs.StringVar(&f.EncryptionLayer, "encryption-layer", f.EncryptionLayer,
		"Which code serves --encryption-provider-config: rekey (this layer) or upstream (k8s.io/apiserver's own encryptionconfig, "+
			"for side-by-side comparisons; no storage migration, no coordination).")
	fs.DurationVar(&f.ReloadPollInterval, "encryption-provider-config-poll-interval", f.ReloadPollInterval,
		"With automatic reload, how often the file is re-read even without file events (default 1m).")

	fs.DurationVar(&f.KMSStatusInterval, "kms-status-interval", f.KMSStatusInterval,
		"How often a healthy KMS v2 plugin is asked for its Status (upstream kube-apiserver: 1m). A plugin's new key id is seen within one interval; "+
			"with --cluster-coordination it is then published to the other apiservers at once.")
	fs.DurationVar(&f.KMSFirstSeedHold, "kms-first-seed-hold", f.KMSFirstSeedHold,
		"With --cluster-coordination, how long a KMS v2 provider that just started (or was built by a reload) holds writes under its first key id "+
			"until every other apiserver's plugin reports that key id; it is not ready meanwhile. At the bound it writes under it anyway "+
			"(error log, rekey_kms_first_seed_hold_expired_total). 0: no hold.")
	fs.DurationVar(&f.KMSSeedMaxAge, "kms-seed-max-age", f.KMSSeedMaxAge,
		"How long one KMS v2 DEK seed encrypts new values while the plugin's key id stays the same; then a new seed is made and wrapped "+
			"by the plugin in the background (writes keep the old one until it is ready, and never fail for it). Upstream kube-apiserver "+
			"only makes a new seed at start and on a key id change. 0: no bound.")
	fs.Int64Var(&f.KMSSeedMaxWrites, "kms-seed-max-writes", f.KMSSeedMaxWrites,
		"How many values one KMS v2 DEK seed encrypts before a new seed is made in the background, as for --kms-seed-max-age. 0: no bound.")
	fs.DurationVar(&f.KMSDEKCacheIdle, "kms-dek-cache-idle", f.KMSDEKCacheIdle,
		"Drop a decrypted KMS v2 DEK source from memory once no read has used it for this long; the next read of a value under it "+
			"asks the plugin's Decrypt again (upstream keeps every entry 24h from when it was cached, used or not). 0: never.")
	fs.IntVar(&f.KMSKeyIDConfirmations, "kms-key-id-confirmations", f.KMSKeyIDConfirmations,
		"How many consecutive healthy KMS v2 Status answers must report a new key id before it acts (a new DEK seed, the write fence, migration); "+
			"the Encrypt that follows must answer with it too. A key id flap shorter than that rewrites nothing; a real rotation acts "+
			"this many Status intervals minus one later. 1: at the first Status (upstream kube-apiserver).")
	fs.DurationVar(&f.KMSDecryptProbeInterval, "kms-decrypt-probe-interval", f.KMSDecryptProbeInterval,
		"How often one stored object per KMS v2 provider and key id (from the storage inventory) is decrypted by its plugin past every DEK cache, "+
			"so that a key the plugin can no longer decrypt with (a deleted key version, an alias re-pointed behind a stable key id) is raised "+
			"(error log, Event KMSDecryptProbeFailed, rekey_kms_decrypt_probe_failing) while cached DEKs still serve every read. 0: never.")
	fs.DurationVar(&f.KMSRetryInterval, "kms-retry-interval", f.KMSRetryInterval, "KMS v2 Status period while unhealthy (default 10s; never longer than --kms-status-interval). For tests.")
	fs.DurationVar(&f.KMSWriteTTL, "kms-write-ttl", f.KMSWriteTTL, "How long KMS v2 writes continue after the last healthy Status (default 3m). For tests.")

	fs.BoolVar(&f.StorageMigration, FlagStorageMigration, f.StorageMigration,
		"When the write key of a scanned resource changes (a reload, or a new KMS v2 key id), re-encrypt its stored objects in etcd with it "+
			"(compare-and-swap; a concurrent update always wins). False only takes inventories of which keys encrypt stored data; "+
			"the key-in-use guards use them either way.")
	fs.Float64Var(&f.StorageMigrationRate, "storage-migration-rate", f.StorageMigrationRate,
		"Maximum objects re-encrypted per second by --storage-migration; 0 is no ceiling. Below it the rate adapts to etcd: it halves "+
			"while the migration's own etcd transactions are slow (p90 over 3× the first second's, at least 20ms) or fail, and climbs back "+
			"50 objects/s (or a tenth of the rate, above 500/s) a second while they are fast (rekey_storage_migration_allowed_rate).")
	fs.Var(&clientLatencyFactorValue{f}, FlagStorageMigrationClientLatencyFactor,
		"Storage migration also halves its rate while this apiserver answers its clients more than this many times slower (p99 of at least 100 requests "+
			"of one class, or of what 5s brought; at least 1ms more) than that class's requests before the migration began (GETs, writes, LISTs and other requests "+
			"are judged apart), and then starts at 100 objects/s, doubling while they are as fast as before "+
			"(the rate holds until their requests are judged); its verifying re-scan is paced the same way; "+
			"on control planes whose CPUs etcd, the apiserver and the migration share, etcd can stay fast while the clients wait. "+
			"Watches and other long-running requests are not timed; a class with fewer than 50 requests in the 10 minutes before has no baseline "+
			"and is not judged (with none, etcd alone paces). 0 leaves the clients out. Set, it wins over --"+FlagStorageMigrationPriority+"'s factor (unset: 1.5, or 3 for fast).")
	fs.StringVar(&f.StorageMigrationPriority, FlagStorageMigrationPriority, f.StorageMigrationPriority,
		"How storage migration trades this apiserver's clients' latency for its own speed: "+
			"gentle (clients within 1.5× their p99 before it in every second, and every migration starts at 100 objects/s, doubling), "+
			"normal (clients within 1.5× over every minute; a migration starts at half the highest rate the cluster's last migration sustained with its clients within target, at least 100/s), "+
			"fast (clients within 3× over every minute; a migration starts at that rate itself). "+
			"--"+FlagStorageMigrationClientLatencyFactor+", when set, replaces the priority's factor.")
	fs.DurationVar(&f.StorageMigrationMaxWatchLag, "storage-migration-max-watch-lag", f.StorageMigrationMaxWatchLag,
		"Storage migration also halves its rate while this apiserver's watch cache of the resource is further behind the migration's own writes "+
			"than this (every rewritten object is an event the cache decodes, one at a time, before any watcher sees it: writing faster only "+
			"delays every watcher), idle cluster or not. 0 leaves the watch cache out.")
	AddStorageMigrationSpaceFlags(fs, &f.StorageMigrationEtcdQuotaBytes, &f.StorageMigrationMaxDBFraction)
	if f.defaults.StorageResources != nil {
		fs.StringSliceVar(&f.StorageResources, FlagStorageMigrationResources, f.StorageResources,
			"Resources the inventory, the migration and the start-up check scan besides every resource the encryption configuration's rules cover "+
				"(named resources where the storage factory stores them; a wildcard rule's resources as found in etcd): "+
				"secrets, widgets.example.com, or name=/registry/path/ for a resource stored at a path of its own.")
	}
	fs.DurationVar(&f.StorageCheckInterval, "storage-migration-check-interval", f.StorageCheckInterval,
		"How often write keys are compared (default 5s). For tests.")
	fs.DurationVar(&f.StorageInventoryInterval, "storage-inventory-interval", f.StorageInventoryInterval,
		"How often a fresh inventory is taken without a key change (default 10m). For tests.")
	fs.BoolVar(&f.AllowDroppingKeysInUse, "unsafe-allow-dropping-keys-in-use", f.AllowDroppingKeysInUse,
		"Apply a reload even when it removes a provider or key that the latest inventory says still encrypts stored objects "+
			"(refused otherwise, naming resource, key and object count), or start with a configuration that cannot read what the last applied one could. "+
			"Disaster recovery only: the data under that key becomes unreadable.")
	fs.DurationVar(&f.BackupRetention, guard.BackupRetentionFlag, f.BackupRetention,
		"How long etcd snapshots are kept (e.g. 168h): a reload or start that drops a key a snapshot within it may need (per the key ledger in etcd) is refused, naming the key and until when to keep it. "+
			"0 (the default) checks nothing, so that clusters without etcd backups are never held back by them.")
	fs.StringVar(&f.EncryptionStateFile, "encryption-state-file", f.EncryptionStateFile,
		"Keep the record of what the last applied encryption configuration could read (key fingerprints, never keys) in this file instead of "+
			"etcd key <coordination-prefix>/applied/<encryption-state-id>. It must survive restarts: at start the configuration on disk is checked against it.")
	fs.StringVar(&f.EncryptionStateID, "encryption-state-id", f.EncryptionStateID,
		"The id in the applied-state key <coordination-prefix>/applied/<id>. Default: k8s.io/apiserver's identity of this apiserver (apiserver-<hash of the host name>). "+
			"Set it when several apiservers share one host and one etcd; it must stay the same across restarts.")

	fs.StringVar(&f.APIServerID, FlagAPIServerID, f.APIServerID,
		"This apiserver's name among the apiservers sharing --etcd-servers (its member key under --coordination-prefix). "+
			"Default: "+f.defaults.APIServerIDDefault+". Set it when several apiservers run on one host.")
	fs.BoolVar(&f.ClusterCoordination, "cluster-coordination", f.ClusterCoordination,
		"Coordinate with the other rekey apiservers through etcd: publish this apiserver's keys under a lease, never start writing with a key "+
			"another live apiserver cannot read (hold it, promote it once all can), migrate stored data on one elected apiserver, and fail "+
			"the rekey-cluster check of /readyz while this configuration cannot read a key the cluster uses. False: act alone.")
	fs.StringVar(&f.CoordinationPrefix, "coordination-prefix", f.CoordinationPrefix,
		"etcd key prefix of the coordination keys (cluster identity, members, migration leader, checkpoint, applied states); must be outside --etcd-prefix. "+
			"Default: "+coordination.DefaultPrefix+" for --etcd-prefix /registry, else "+coordination.DefaultPrefix+"-<etcd-prefix without its leading />, "+
			"so clusters sharing an etcd under different --etcd-prefix values keep apart.")
	fs.DurationVar(&f.ClusterLeaseTTL, "cluster-lease-ttl", f.ClusterLeaseTTL,
		"Lease of this apiserver's member key and election session: a dead apiserver stops counting this long after it died (whole seconds, at least 2s).")
	fs.DurationVar(&f.ClusterDisagreementAlarm, "cluster-disagreement-alarm", f.ClusterDisagreementAlarm,
		"Raise an alarm (metric rekey_cluster_disagreement_alarm, status condition, log line) when the apiservers disagree about a write key for longer than this.")

	// Test knobs are hidden from --help: upstream has no such setting, and they exist so
	// that tests need not wait minutes.
	for _, name := range []string{"kms-retry-interval", "kms-write-ttl", "storage-migration-check-interval", "storage-inventory-interval"} {
		if err := fs.MarkHidden(name); err != nil {
			panic(err) // declared just above
		}
	}
}

// clientLatencyFactorValue is --storage-migration-client-latency-factor: a float64
// flag (the same type, default and text as pflag's) that records being set, so that a
// factor given on the command line wins over --storage-migration-priority's even when
// it equals the default.
type clientLatencyFactorValue struct{ f *Flags }

func (v *clientLatencyFactorValue) String() string {
	return strconv.FormatFloat(v.f.StorageMigrationClientLatencyFactor, 'g', -1, 64)
}

func (v *clientLatencyFactorValue) Set(s string) error {
	x, err := strconv.ParseFloat(s, 64)
	if err != nil {
		return err
	}
	v.f.StorageMigrationClientLatencyFactor, v.f.clientLatencyFactorSet = x, true
	return nil
}

func (v *clientLatencyFactorValue) Type() string { return "float64" }

// Pacing is the clients' latency factor and the priority storage migrations are paced
// with: the factor is StorageMigrationClientLatencyFactor when it was set (on the
// command line, or in process to anything but its default), else 0, which pace reads
// as the priority's (pace.Options.ServingFactor). The flags are valid (Validate).
func (f *Flags) Pacing() (servingFactor float64, priority pace.Priority) {
	priority, _ = pace.ParsePriority(f.StorageMigrationPriority)
	servingFactor = f.StorageMigrationClientLatencyFactor
	if !f.clientLatencyFactorSet && servingFactor == pace.DefaultServingFactor {
		servingFactor = 0
	}
	return servingFactor, priority
}

// Rekey reports whether this layer serves the configuration (not upstream's); the
// zero value's empty EncryptionLayer means rekey.
func (f *Flags) Rekey() bool {
	return f.EncryptionLayer == "" || f.EncryptionLayer == EncryptionLayerRekey
}

// Validate checks the flags on their own; Options.Validate checks them against the
// binary's (--etcd-prefix, the default --apiserver-id).
func (f *Flags) Validate() []error {
	var errs []error
	if f.EncryptionLayer != EncryptionLayerRekey && f.EncryptionLayer != EncryptionLayerUpstream {
		errs = append(errs, fmt.Errorf("--encryption-layer=%q: must be %q or %q", f.EncryptionLayer, EncryptionLayerRekey, EncryptionLayerUpstream))
	}
	// Where migration is opt-in, asking for it with upstream's layer is a mistake to
	// report; where it is on by default (both binaries now), upstream's layer simply runs
	// without it.
	if f.EncryptionLayer == EncryptionLayerUpstream && f.StorageMigration && !f.defaults.StorageMigration {
		errs = append(errs, fmt.Errorf("--%s needs --encryption-layer=%s: upstream's layer has no storage migration", FlagStorageMigration, EncryptionLayerRekey))
	}
	if f.BackupRetention < 0 {
		errs = append(errs, fmt.Errorf("--%s=%s: must be 0 (no check) or how long etcd snapshots are kept", guard.BackupRetentionFlag, f.BackupRetention))
	}
	if f.KMSFirstSeedHold < 0 {
		errs = append(errs, fmt.Errorf("--kms-first-seed-hold=%s: must be 0 (no hold) or positive", f.KMSFirstSeedHold))
	}
	if f.KMSDecryptProbeInterval < 0 {
		errs = append(errs, fmt.Errorf("--kms-decrypt-probe-interval=%s: must not be negative (0 probes never)", f.KMSDecryptProbeInterval))
	}
	if f.KMSKeyIDConfirmations < 0 {
		errs = append(errs, fmt.Errorf("--kms-key-id-confirmations=%d: must be at least 1 (0 keeps the default, %d)", f.KMSKeyIDConfirmations, kmsv2.DefaultKeyIDConfirmations))
	}
	if f.KMSSeedMaxAge < 0 {
		errs = append(errs, fmt.Errorf("--kms-seed-max-age=%s: must be 0 (no bound) or positive", f.KMSSeedMaxAge))
	}
	if f.KMSSeedMaxWrites < 0 {
		errs = append(errs, fmt.Errorf("--kms-seed-max-writes=%d: must be 0 (no bound) or positive", f.KMSSeedMaxWrites))
	}
	if f.KMSDEKCacheIdle < 0 {
		errs = append(errs, fmt.Errorf("--kms-dek-cache-idle=%s: must be 0 (never) or positive", f.KMSDEKCacheIdle))
	}
	if f.StorageMigrationRate < 0 {
		errs = append(errs, fmt.Errorf("--storage-migration-rate=%v: must be 0 (unlimited) or positive", f.StorageMigrationRate))
	}
	if f := f.StorageMigrationClientLatencyFactor; f != 0 && f <= 1 {
		errs = append(errs, fmt.Errorf("--%s=%v: must be above 1 (clients allowed that many times slower), or 0 to leave them out", FlagStorageMigrationClientLatencyFactor, f))
	}
	if _, err := pace.ParsePriority(f.StorageMigrationPriority); err != nil {
		errs = append(errs, fmt.Errorf("--%s=%q: must be %s, %s or %s", FlagStorageMigrationPriority, f.StorageMigrationPriority, pace.PriorityGentle, pace.PriorityNormal, pace.PriorityFast))
	}
	errs = append(errs, ValidateStorageMigrationSpace(f.StorageMigrationEtcdQuotaBytes, f.StorageMigrationMaxDBFraction)...)
	if f.ClusterCoordination && f.Rekey() && f.APIServerID != "" {
		if err := coordination.ValidateID(f.APIServerID); err != nil {
			errs = append(errs, err)
		}
	}
	for _, r := range f.StorageResources {
		if _, err := migrate.ParseResource(storagelayout.Kube(migrate.DefaultEtcdPrefix), r); err != nil {
			errs = append(errs, fmt.Errorf("--%s: %w", FlagStorageMigrationResources, err))
		}
	}
	return errs
}

// DefaultCoordinationPrefix is --coordination-prefix's default for --etcd-prefix
// etcdPrefix. kube-apiserver's default /registry keeps /rekey, where existing
// deployments have their keys; any other resource prefix gets its own coordination
// prefix, /rekey-<etcd-prefix without its leading slash>, so that two clusters sharing
// one etcd under different --etcd-prefix values do not coordinate with each other by
// default. The dash keeps it out of /rekey/... (it never nests under another cluster's
// members or applied states), and it cannot lie inside the resource prefix nor contain
// it: "/rekey-" followed by a path never starts with that path.
func DefaultCoordinationPrefix(etcdPrefix string) string {
	p := strings.Trim(path.Clean("/"+etcdPrefix), "/")
	if p == "" || p == "registry" {
		return coordination.DefaultPrefix
	}
	return coordination.DefaultPrefix + "-" + p
}
