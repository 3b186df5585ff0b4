// Command apiserver-shim is a small kube-apiserver build with the rekey agent inside:
// k8s.io/apiserver serving core/v1 Secrets and ConfigMaps from etcd, encrypted at rest
// exactly as kube-apiserver does it, configured with kube-apiserver's flag names.
//
//	apiserver-shim --encryption-provider-config enc.yaml --token-auth-file tokens.csv \
//	    --data-dir ./data --cert-dir ./data/certs
//
// With no --etcd-servers it runs an embedded etcd in --data-dir, so one command runs
// everything.
package main

import (
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/spf13/cobra"
	utilruntime "k8s.io/apimachinery/pkg/util/runtime"
	genericapiserver "k8s.io/apiserver/pkg/server"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/cli"
	cliflag "k8s.io/component-base/cli/flag"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/component-base/version/verflag"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/internal/shim"
	"github.com/rekey-io/rekey/pkg/cluster"
)

// defaultKMSStatusInterval is shorter than kube-apiserver's minute so that a plugin's
// new key id reaches the write fence and the migrator quickly.
const defaultKMSStatusInterval = 15 * time.Second

func main() {
	os.Exit(cli.Run(newCommand()))
}

type flags struct {
	opts        shim.Options
	bindAddress string
	portFile    string
	logging     *logsapi.LoggingConfiguration
}

func newCommand() *cobra.Command {
	f := &flags{
		opts: shim.Options{
			AutomaticReload:  true,
			StorageMigration: true,
			EncryptionLayer:  shim.LayerRekey,

			ClusterCoordination:      true,
			CoordinationPrefix:       cluster.DefaultPrefix,
			ClusterLeaseTTL:          cluster.DefaultLeaseTTL,
			ClusterDisagreementAlarm: cluster.DefaultDisagreementAlarm,
			KMSTimings:               shim.KMSTimings{StatusInterval: defaultKMSStatusInterval},
			EtcdPrefix:               shim.DefaultEtcdPrefix,
			SecurePort:               6443,
			DataDir:                  "rekey-data",
		},
		bindAddress: "127.0.0.1",
		logging:     logsapi.NewLoggingConfiguration(),
	}
	utilruntime.Must(logsapi.AddFeatureGates(utilfeature.DefaultMutableFeatureGate))

	cmd := &cobra.Command{
		Use:   "apiserver-shim",
		Short: "A kube-apiserver in miniature with the rekey encryption agent inside",
		Long: `apiserver-shim serves core/v1 Secrets and ConfigMaps from etcd, stored exactly as
kube-apiserver stores them (protobuf at <etcd-prefix>/<resource>/<namespace>/<name>),
encrypted by the configuration in --encryption-provider-config. TLS and bearer-token
authentication are always on; /healthz, /livez and /readyz are open to probes.

Stored data follows the keys: when the write key of a resource changes, its stored
objects are re-encrypted in etcd (--storage-migration=false only counts them), and a
reload that would drop a key still encrypting stored objects is refused, the old
configuration serving on (--unsafe-allow-dropping-keys-in-use overrides this for
disaster recovery). The inventory and the migration state are in /rekey/status under
"storage" and in /metrics as rekey_storage_*.

Several shims on one etcd coordinate (--cluster-coordination, on by default): none starts
writing with a key another live shim cannot read (the new key is held, the previous one
writes, until all can read it), stored data is migrated once by an elected shim, and a
shim whose file cannot read a key the others use fails /readyz. See "cluster" in
/rekey/status, rekey status, and docs/cluster.md.`,
		SilenceUsage: true,
		RunE: func(cmd *cobra.Command, _ []string) error {
			verflag.PrintAndExitIfRequested()
			if err := logsapi.ValidateAndApply(f.logging, utilfeature.DefaultFeatureGate); err != nil {
				return err
			}
			cliflag.PrintFlags(cmd.Flags())
			return f.run()
		},
		Args: cobra.NoArgs,
	}

	fss := cliflag.NamedFlagSets{}
	enc := fss.FlagSet("encryption")
	enc.StringVar(&f.opts.EncryptionConfig, "encryption-provider-config", f.opts.EncryptionConfig,
		"The file containing the EncryptionConfiguration for storing secrets (and other resources) in etcd. Empty stores plaintext.")
	enc.BoolVar(&f.opts.AutomaticReload, "encryption-provider-config-automatic-reload", f.opts.AutomaticReload,
		"Apply edits of --encryption-provider-config without a restart. Unlike kube-apiserver, on by default.")
	enc.StringVar(&f.opts.EncryptionLayer, "encryption-layer", f.opts.EncryptionLayer,
		"Which implementation encrypts: rekey (the agent) or upstream (k8s.io/apiserver's encryptionconfig, for side-by-side benchmarks).")

	enc.DurationVar(&f.opts.KMSTimings.StatusInterval, "kms-status-interval", f.opts.KMSTimings.StatusInterval,
		"How often a healthy KMS v2 plugin is asked for its Status (kube-apiserver: 1m). A plugin's new key id is seen within one interval; "+
			"with --cluster-coordination it is then published to the other apiservers at once.")
	enc.DurationVar(&f.opts.KMSTimings.RetryInterval, "kms-retry-interval", 0, "KMS v2 Status period while unhealthy (default 10s). For tests.")
	enc.DurationVar(&f.opts.KMSTimings.WriteTTL, "kms-write-ttl", 0, "How long KMS v2 writes continue after the last healthy Status (default 3m). For tests.")
	for _, name := range []string{"kms-retry-interval", "kms-write-ttl"} {
		utilruntime.Must(enc.MarkHidden(name))
	}

	storage := fss.FlagSet("storage migration")
	storage.BoolVar(&f.opts.StorageMigration, "storage-migration", f.opts.StorageMigration,
		"When the write key of secrets or configmaps changes (a reload, or a new KMS v2 key id), re-encrypt their stored objects in etcd with it "+
			"(compare-and-swap; a concurrent update always wins). False only takes inventories of which keys encrypt stored data.")
	storage.Float64Var(&f.opts.StorageMigrationRate, "storage-migration-rate", 0, "Maximum objects re-encrypted per second by --storage-migration; 0 is unlimited.")
	storage.BoolVar(&f.opts.AllowDroppingKeysInUse, "unsafe-allow-dropping-keys-in-use", false,
		"Apply a reload even when it removes a provider or key that the latest inventory says still encrypts stored objects "+
			"(refused otherwise, naming resource, key and object count), or start with a configuration that cannot read what the last applied one could. "+
			"Disaster recovery only: the data under that key becomes unreadable.")
	storage.StringVar(&f.opts.EncryptionStateFile, "encryption-state-file", "",
		"Keep the record of what the last applied encryption configuration could read (key fingerprints, never keys) in this file instead of "+
			"etcd key /rekey/applied/<apiserver-id>. It must survive restarts: at start the configuration on disk is checked against it.")
	storage.StringVar(&f.opts.EncryptionStateID, "encryption-state-id", "",
		"The <apiserver-id> of the applied-state key /rekey/applied/<apiserver-id> in etcd. Default: the apiserver identity (derived from the host name). "+
			"Set it when several apiservers share one host and one etcd; it must stay the same across restarts.")
	storage.DurationVar(&f.opts.StorageCheckInterval, "storage-migration-check-interval", 0, "How often write keys are compared (default 5s). For tests.")
	storage.DurationVar(&f.opts.StorageInventoryInterval, "storage-inventory-interval", 0, "How often a fresh inventory is taken without a key change (default 10m). For tests.")
	for _, name := range []string{"storage-migration-check-interval", "storage-inventory-interval"} {
		utilruntime.Must(storage.MarkHidden(name))
	}

	coord := fss.FlagSet("cluster coordination")
	coord.StringVar(&f.opts.APIServerID, "apiserver-id", "",
		"This apiserver's name among the apiservers sharing --etcd-servers (default <hostname>:<secure-port>; with --secure-port 0, <hostname>-<random>).")
	coord.BoolVar(&f.opts.ClusterCoordination, "cluster-coordination", f.opts.ClusterCoordination,
		"Coordinate with the other apiservers through etcd: publish this apiserver's keys under a lease, never start writing with a key "+
			"another live apiserver cannot read (hold it, promote it once all can), migrate stored data on one elected apiserver, and fail "+
			"/readyz while this configuration cannot read a key the cluster uses. False: act alone.")
	coord.StringVar(&f.opts.CoordinationPrefix, "coordination-prefix", f.opts.CoordinationPrefix,
		"etcd key prefix of the coordination keys (members, migration leader, checkpoint); must be outside --etcd-prefix.")
	coord.DurationVar(&f.opts.ClusterLeaseTTL, "cluster-lease-ttl", f.opts.ClusterLeaseTTL,
		"Lease of this apiserver's member key and election session: a dead apiserver stops counting this long after it died (whole seconds, at least 2s).")
	coord.DurationVar(&f.opts.ClusterDisagreementAlarm, "cluster-disagreement-alarm", f.opts.ClusterDisagreementAlarm,
		"Raise an alarm (metric rekey_cluster_disagreement_alarm, status condition, log line) when the apiservers disagree about a write key for longer than this.")

	etcd := fss.FlagSet("etcd")
	etcd.StringSliceVar(&f.opts.EtcdServers, "etcd-servers", f.opts.EtcdServers,
		"etcd servers to connect to (scheme://ip:port), comma separated. Empty runs an embedded etcd in --data-dir.")
	etcd.StringVar(&f.opts.EtcdCAFile, "etcd-cafile", "",
		"SSL Certificate Authority file used to secure etcd communication. Used by the storage backend and by every etcd client of the rekey layer "+
			"(cluster coordination, storage migration, the applied-state check).")
	etcd.StringVar(&f.opts.EtcdCertFile, "etcd-certfile", "", "SSL certification file used to secure etcd communication (client certificate; with --etcd-keyfile).")
	etcd.StringVar(&f.opts.EtcdKeyFile, "etcd-keyfile", "", "SSL key file used to secure etcd communication (with --etcd-certfile).")
	etcd.StringVar(&f.opts.EtcdPrefix, "etcd-prefix", f.opts.EtcdPrefix, "The prefix to prepend to all resource paths in etcd.")
	etcd.DurationVar(&f.opts.EtcdConnectTimeout, "etcd-connect-timeout", shim.DefaultEtcdConnectTimeout,
		"How long to wait at start for --etcd-servers to answer before giving up.")
	etcd.StringVar(&f.opts.DataDir, "data-dir", f.opts.DataDir, "Directory of the embedded etcd's data (used when --etcd-servers is empty).")
	etcd.BoolVar(&f.opts.EtcdUnsafeNoFsync, "etcd-unsafe-no-fsync", false,
		"Disable fsync in the embedded etcd. Unsafe: for tests and benchmarks only.")
	etcd.StringVar(&f.opts.EtcdLogLevel, "etcd-log-level", "warn", "Log level of the embedded etcd: debug, info, warn, error.")

	serving := fss.FlagSet("secure serving")
	serving.StringVar(&f.bindAddress, "bind-address", f.bindAddress, "The IP address on which to listen for --secure-port.")
	serving.IntVar(&f.opts.SecurePort, "secure-port", f.opts.SecurePort, "The port on which to serve HTTPS; 0 picks a free port (see --port-file).")
	serving.StringVar(&f.opts.CertDir, "cert-dir", "",
		"The directory holding apiserver.crt and apiserver.key; a self-signed pair is generated there when absent. Default <data-dir>/certs.")
	serving.StringVar(&f.portFile, "port-file", "", "Write the serving port to this file once listening (for --secure-port 0).")

	authn := fss.FlagSet("authentication")
	authn.StringVar(&f.opts.TokenAuthFile, "token-auth-file", "",
		"A kube-apiserver static token file: lines of token,user,uid,\"group1,group2\". Required: authentication is always on.")

	logsapi.AddFlags(f.logging, fss.FlagSet("logs"))
	verflag.AddFlags(fss.FlagSet("global"))

	fs := cmd.Flags()
	for _, name := range fss.Order {
		fs.AddFlagSet(fss.FlagSets[name])
	}
	cliflag.SetUsageAndHelpFunc(cmd, fss, 0)
	return cmd
}

func (f *flags) run() error {
	ip := net.ParseIP(f.bindAddress)
	if ip == nil {
		return fmt.Errorf("--bind-address %q is not an IP address", f.bindAddress)
	}
	f.opts.BindAddress = ip
	if f.opts.CertDir == "" {
		f.opts.CertDir = filepath.Join(f.opts.DataDir, "certs")
	}
	if f.opts.TokenAuthFile == "" {
		return fmt.Errorf("--token-auth-file is required: authentication is always on")
	}
	if f.opts.EncryptionConfig != "" {
		// Fail early and plainly on a missing or unreadable file, before etcd starts.
		fh, err := os.Open(f.opts.EncryptionConfig)
		if err != nil {
			return fmt.Errorf("--encryption-provider-config: %w", err)
		}
		fh.Close()
	}
	f.opts.Logger = klog.Background()
	if f.portFile != "" {
		f.opts.Started = func(i shim.Info) {
			if err := os.WriteFile(f.portFile, []byte(strconv.Itoa(i.Port)+"\n"), 0o644); err != nil {
				klog.ErrorS(err, "Cannot write --port-file", "path", f.portFile)
			}
		}
	}
	return shim.Run(genericapiserver.SetupSignalContext(), f.opts)
}
