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
	"github.com/rekey-io/rekey/pkg/layer"
)

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
			AutomaticReload: true,
			Rekey:           layer.NewFlags(layer.ShimDefaults()),
			EtcdPrefix:      shim.DefaultEtcdPrefix,
			SecurePort:      6443,
			DataDir:         "rekey-data",
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
	// Every other flag of the encryption layer is pkg/layer's, declared there once for
	// this shim and dist/kube-apiserver alike.
	f.opts.Rekey.AddFlags(fss.FlagSet("rekey"))

	etcd := fss.FlagSet("etcd")
	etcd.StringSliceVar(&f.opts.EtcdServers, "etcd-servers", f.opts.EtcdServers,
		"etcd servers to connect to (scheme://ip:port), comma separated. Empty runs an embedded etcd in --data-dir.")
	etcd.StringVar(&f.opts.EtcdCAFile, "etcd-cafile", "",
		"SSL Certificate Authority file used to secure etcd communication. Used by the storage backend and by the rekey layer's etcd client "+
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

	// kube-apiserver's --feature-gates: the generic apiserver's gates (e.g.
	// DetectCacheInconsistency, whose periodic full list is a load of its own at a
	// million objects) and the logging ones. Adding the flag closes the process's
	// feature gate to new gates, so newCommand runs once per process.
	utilfeature.DefaultMutableFeatureGate.AddFlag(fss.FlagSet("feature gates"))
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
