// Package shim is a small kube-apiserver: k8s.io/apiserver serving core/v1 Secrets and
// ConfigMaps from etcd, stored exactly as kube-apiserver stores them (protobuf, keys
// <prefix>/<resource>/<namespace>/<name>), through an encryption layer — rekey's agent
// or, for side-by-side comparisons, upstream's encryptionconfig. cmd/apiserver-shim is
// its command line; tests and benchmarks call Run in-process.
package shim

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apiserver/pkg/authentication/user"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	serverstorage "k8s.io/apiserver/pkg/server/storage"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/util/compatibility"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/internal/shim/openapi"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Defaults of Options, matching kube-apiserver where it has the same flag.
const (
	DefaultEtcdPrefix         = "/registry"
	DefaultEtcdConnectTimeout = 10 * time.Second
	// servingCertPairName names the generated serving cert: <cert-dir>/apiserver.crt.
	servingCertPairName = "apiserver"
)

// Options configure one shim. The zero value is not usable: CertDir and either
// TokenAuthFile or Tokens are required, and DataDir when EtcdServers is empty.
type Options struct {
	// EncryptionConfig is the EncryptionConfiguration file; empty stores plaintext.
	EncryptionConfig string
	// AutomaticReload watches EncryptionConfig and applies edits without a restart.
	AutomaticReload bool
	// ReloadPollInterval is how often the file is re-read without file events
	// (default 1 min; file events apply edits at once).
	ReloadPollInterval time.Duration
	// EncryptionLayer is LayerRekey (default) or LayerUpstream.
	EncryptionLayer string
	// KMS builds KMS v2 providers for the rekey layer; default kmsv2.NewFactory with
	// KMSTimings.
	KMS transformers.KMSFactory
	// KMSTimings override the KMS v2 lifecycle defaults of the rekey layer (tests).
	KMSTimings KMSTimings

	// EtcdServers are etcd client URLs; empty starts an embedded etcd in DataDir.
	EtcdServers []string
	// EtcdCAFile, EtcdCertFile and EtcdKeyFile secure the connection to EtcdServers
	// (kube-apiserver's --etcd-cafile, --etcd-certfile, --etcd-keyfile): the storage
	// backend and every etcd client of the rekey layer (cluster coordination, storage
	// migration, the applied-state check) use them.
	EtcdCAFile   string
	EtcdCertFile string
	EtcdKeyFile  string
	// EtcdPrefix prefixes every key (default /registry).
	EtcdPrefix string
	// EtcdConnectTimeout bounds the start-up check of external etcd servers.
	EtcdConnectTimeout time.Duration
	// DataDir holds the embedded etcd's data.
	DataDir string
	// EtcdUnsafeNoFsync turns fsync off in the embedded etcd (tests, benchmarks).
	EtcdUnsafeNoFsync bool
	// EtcdLogLevel is the embedded etcd's log level (default warn).
	EtcdLogLevel string

	// BindAddress is the serving address (default 127.0.0.1).
	BindAddress net.IP
	// SecurePort is the HTTPS port; 0 picks a free one (reported through Started).
	SecurePort int
	// CertDir holds apiserver.crt/.key; a self-signed pair is generated when absent.
	CertDir string
	// TokenAuthFile is a kube-apiserver static token file (token,user,uid,"groups").
	TokenAuthFile string
	// Tokens are used when TokenAuthFile is empty (in-process callers).
	Tokens map[string]*user.DefaultInfo

	// StorageMigration re-encrypts the stored Secrets and ConfigMaps when the write key
	// of their rule changes (rekey layer; --storage-migration, on by default in the
	// command). Off, the layer still takes inventories for the status document, the
	// metrics and the key-in-use guard.
	StorageMigration bool
	// StorageMigrationRate bounds rewrites per second; 0 is unlimited.
	StorageMigrationRate float64
	// StorageCheckInterval is how often the write keys are compared (default 5 s);
	// StorageInventoryInterval how often a fresh inventory is taken without a change
	// (default 10 min).
	StorageCheckInterval     time.Duration
	StorageInventoryInterval time.Duration
	// AllowDroppingKeysInUse lets a reload through the key-in-use guard anyway
	// (--unsafe-allow-dropping-keys-in-use; disaster recovery only), and a start whose
	// configuration cannot read what the last applied one could.
	AllowDroppingKeysInUse bool
	// EncryptionStateID names this apiserver's applied-encryption state in etcd
	// (guard.AppliedStatePrefix + id); default: the apiserver identity, which
	// k8s.io/apiserver derives from the host name and so survives restarts.
	EncryptionStateID string
	// EncryptionStateFile keeps the applied-encryption state in this file instead of
	// etcd (--encryption-state-file); it must survive restarts.
	EncryptionStateFile string

	// APIServerID names this apiserver among the others sharing its etcd
	// (--apiserver-id; default <hostname>:<secure-port>).
	APIServerID string
	// ClusterCoordination makes the rekey layer coordinate with the other apiservers
	// through etcd (pkg/cluster): a write fence, one elected migrator, readiness of
	// stragglers (--cluster-coordination; on in the command, off in the zero value).
	ClusterCoordination bool
	// CoordinationPrefix is where the coordination keys live (default /rekey); it must
	// be outside EtcdPrefix.
	CoordinationPrefix string
	// ClusterLeaseTTL is the member lease (default 10 s); ClusterDisagreementAlarm how
	// long the members may disagree about a write key before the alarm (default 2 min).
	ClusterLeaseTTL          time.Duration
	ClusterDisagreementAlarm time.Duration

	// MetricsRegistry receives the encryption layer's metrics (default: a new one). It
	// is served at /metrics together with the process-wide registry k8s.io/apiserver
	// uses; keeping them apart lets upstream's own registrations of the same metric
	// names (linked in for the upstream layer) coexist with rekey's.
	MetricsRegistry metrics.KubeRegistry
	// Logger defaults to klog's background logger.
	Logger klog.Logger
	// Started is called once the server listens, before /readyz turns ready.
	Started func(Info)
}

// KMSTimings shorten the KMS v2 provider lifecycle for tests; zero keeps a default.
type KMSTimings struct {
	// StatusInterval is the Status period while healthy (default 1 min).
	StatusInterval time.Duration
	// RetryInterval is the Status period while unhealthy (default 10 s).
	RetryInterval time.Duration
	// WriteTTL is how long writes continue after the last healthy Status: the grace
	// window of a plugin outage (default 3 min).
	WriteTTL time.Duration
}

// Info describes a started shim.
type Info struct {
	// URL is the base URL, e.g. https://127.0.0.1:6443.
	URL string
	// Port is the secure port.
	Port int
	// CAFile verifies the serving certificate (the self-signed cert itself).
	CAFile string
	// EtcdServers are the client URLs of the etcd in use (embedded or external).
	EtcdServers []string
	// EtcdPrefix is the key prefix.
	EtcdPrefix string
	// StatusPath is where the encryption layer's status document is served, if any.
	StatusPath string
}

func (o *Options) complete() error {
	if o.EncryptionLayer == "" {
		o.EncryptionLayer = LayerRekey
	}
	if o.EtcdPrefix == "" {
		o.EtcdPrefix = DefaultEtcdPrefix
	}
	if o.EtcdConnectTimeout <= 0 {
		o.EtcdConnectTimeout = DefaultEtcdConnectTimeout
	}
	if o.EtcdLogLevel == "" {
		o.EtcdLogLevel = "warn"
	}
	if o.BindAddress == nil {
		o.BindAddress = net.IPv4(127, 0, 0, 1)
	}
	if o.Logger.GetSink() == nil {
		o.Logger = klog.Background()
	}
	if o.CertDir == "" {
		return errors.New("--cert-dir is required: the serving certificate is read from or generated into it")
	}
	if len(o.EtcdServers) == 0 && (o.EtcdCAFile != "" || o.EtcdCertFile != "" || o.EtcdKeyFile != "") {
		return errors.New("--etcd-cafile, --etcd-certfile and --etcd-keyfile need --etcd-servers: the embedded etcd serves plaintext on loopback")
	}
	if (o.EtcdCertFile == "") != (o.EtcdKeyFile == "") {
		return errors.New("--etcd-certfile and --etcd-keyfile go together: set both for a client certificate, or neither")
	}
	if len(o.EtcdServers) == 0 && o.DataDir == "" {
		return errors.New("--data-dir is required when --etcd-servers is empty (embedded etcd)")
	}
	if o.SecurePort < 0 || o.SecurePort > 65535 {
		return fmt.Errorf("--secure-port %d must be between 0 and 65535 (0 picks a free port)", o.SecurePort)
	}
	if o.EncryptionLayer == LayerUpstream && o.KMS != nil {
		o.KMS = nil // upstream builds its own KMS v2 clients
	}
	if o.CoordinationPrefix == "" {
		o.CoordinationPrefix = cluster.DefaultPrefix
	}
	if o.APIServerID == "" {
		o.APIServerID = defaultAPIServerID(o.SecurePort)
	}
	if o.clustered() {
		if err := cluster.ValidatePrefix(o.CoordinationPrefix, o.EtcdPrefix); err != nil {
			return err
		}
		if err := cluster.ValidateID(o.APIServerID); err != nil {
			return err
		}
	}
	return nil
}

// clustered reports whether the rekey layer coordinates with other apiservers.
func (o *Options) clustered() bool {
	return o.ClusterCoordination && o.EncryptionLayer == LayerRekey && o.EncryptionConfig != ""
}

// defaultAPIServerID is <hostname>:<port>; with a port picked at start (0) the port is
// not known yet, so a random suffix keeps ids of shims on one host apart.
func defaultAPIServerID(port int) string {
	host, err := os.Hostname()
	if err != nil || host == "" {
		host = "localhost"
	}
	if port != 0 {
		return net.JoinHostPort(host, strconv.Itoa(port))
	}
	var b [4]byte
	_, _ = rand.Read(b[:])
	return fmt.Sprintf("%s-%x", host, b)
}

// Run starts etcd (unless EtcdServers are given) and the shim, and serves until ctx is
// cancelled; it returns after a graceful shutdown.
func Run(ctx context.Context, o Options) error {
	if err := o.complete(); err != nil {
		return err
	}
	logger := o.Logger
	reg := o.MetricsRegistry
	if reg == nil {
		reg = metrics.NewKubeRegistry()
	}

	// Everything that can fail on user input is checked before etcd starts.
	authn, err := newAuthenticator(o.TokenAuthFile, o.Tokens)
	if err != nil {
		return err
	}
	sch, err := newAPIScheme()
	if err != nil {
		return err
	}
	c := genericapiserver.NewConfig(sch.codecs)
	var enc encryptionLayer
	if !o.clustered() {
		// Without coordination the file is checked before etcd starts.
		if enc, err = newEncryptionLayer(ctx, &o, reg, c.APIServerID, layer.Etcd{}); err != nil {
			return err
		}
		defer enc.close()
	}

	etcd := layer.Etcd{Servers: o.EtcdServers, CAFile: o.EtcdCAFile, CertFile: o.EtcdCertFile, KeyFile: o.EtcdKeyFile}
	if len(etcd.Servers) == 0 {
		start := time.Now()
		e, err := startEmbeddedEtcd(ctx, o.DataDir, o.EtcdUnsafeNoFsync, o.EtcdLogLevel)
		if err != nil {
			return err
		}
		defer e.close()
		etcd.Servers = e.endpoints
		logger.Info("Embedded etcd ready", "dataDir", o.DataDir, "endpoints", etcd.Servers, "elapsed", time.Since(start))
	} else if err := checkEtcd(ctx, etcd, o.EtcdConnectTimeout); err != nil {
		return err
	}
	if o.clustered() {
		// The write fence must know the other apiservers before the first configuration
		// is applied, so the layer starts after etcd.
		if enc, err = newEncryptionLayer(ctx, &o, reg, c.APIServerID, etcd); err != nil {
			return err
		}
		defer enc.close()
	}
	stateID := o.EncryptionStateID
	if stateID == "" {
		stateID = c.APIServerID
	}
	if err := enc.checkStart(ctx, etcd, stateID); err != nil {
		return err
	}

	c.EffectiveVersion = compatibility.DefaultBuildEffectiveVersion()
	c.FeatureGate = utilfeature.DefaultFeatureGate
	c.PublicAddress = o.BindAddress
	if o.BindAddress.IsUnspecified() {
		c.PublicAddress = net.IPv4(127, 0, 0, 1)
	}

	serving := genericoptions.NewSecureServingOptions()
	serving.BindAddress = o.BindAddress
	serving.BindPort = o.SecurePort
	serving.ServerCert.CertDirectory = o.CertDir
	serving.ServerCert.PairName = servingCertPairName
	if o.SecurePort == 0 {
		l, _, err := genericoptions.CreateListener("tcp", net.JoinHostPort(o.BindAddress.String(), "0"), net.ListenConfig{})
		if err != nil {
			return fmt.Errorf("cannot listen on %s: %w", o.BindAddress, err)
		}
		serving.Listener = l
	}
	if err := serving.MaybeDefaultWithSelfSignedCerts("localhost", []string{"localhost"}, []net.IP{net.IPv4(127, 0, 0, 1)}); err != nil {
		return fmt.Errorf("serving certificate in --cert-dir %q: %w", o.CertDir, err)
	}
	if err := serving.WithLoopback().ApplyTo(&c.SecureServing, &c.LoopbackClientConfig); err != nil {
		return fmt.Errorf("secure serving: %w", err)
	}
	_, port, err := c.SecureServing.HostPort()
	if err != nil {
		return err
	}
	c.ExternalAddress = net.JoinHostPort(c.PublicAddress.String(), strconv.Itoa(port))

	c.BuildHandlerChainFunc = func(h http.Handler, c *genericapiserver.Config) http.Handler {
		return genericapiserver.DefaultBuildHandlerChain(withMetrics(h, reg), c)
	}
	c.Authentication.Authenticator = authn
	c.Authorization.Authorizer = authenticatedOnly()

	namer := openapinamer.NewDefinitionNamer(sch.scheme)
	c.OpenAPIConfig = genericapiserver.DefaultOpenAPIConfig(openapi.GetOpenAPIDefinitions, namer)
	c.OpenAPIConfig.Info.Title = "rekey apiserver-shim"
	c.OpenAPIV3Config = genericapiserver.DefaultOpenAPIV3Config(openapi.GetOpenAPIDefinitions, namer)
	c.OpenAPIV3Config.Info.Title = "rekey apiserver-shim"

	codec, versioner, err := serverstorage.NewStorageCodec(serverstorage.StorageCodecConfig{
		StorageMediaType:  runtime.ContentTypeProtobuf,
		StorageSerializer: sch.codecs,
		StorageVersion:    corev1.SchemeGroupVersion,
		MemoryVersion:     internalVersion,
	})
	if err != nil {
		return fmt.Errorf("storage codec: %w", err)
	}
	backend := storagebackend.NewDefaultConfig(o.EtcdPrefix, codec)
	backend.EncodeVersioner = versioner
	backend.Transport.ServerList = etcd.Servers
	backend.Transport.TrustedCAFile = o.EtcdCAFile
	backend.Transport.CertFile = o.EtcdCertFile
	backend.Transport.KeyFile = o.EtcdKeyFile
	etcdOpts := genericoptions.NewEtcdOptions(backend)
	// The layer sets c.ResourceTransformers first; EtcdOptions keeps a non-nil value and
	// wraps every resource's storage config with TransformerForResource.
	if err := enc.install(c, etcdOpts); err != nil {
		return err
	}
	if err := etcdOpts.ApplyTo(c); err != nil {
		return fmt.Errorf("etcd storage: %w", err)
	}
	if err := enc.startStorage(c); err != nil {
		return err
	}

	info := Info{
		URL:         "https://" + c.ExternalAddress,
		Port:        port,
		CAFile:      filepath.Join(o.CertDir, servingCertPairName+".crt"),
		EtcdServers: etcd.Servers,
		EtcdPrefix:  o.EtcdPrefix,
		StatusPath:  enc.statusPath(),
	}
	if o.Started != nil {
		if err := c.AddPostStartHook("rekey-shim-started", func(genericapiserver.PostStartHookContext) error {
			o.Started(info)
			return nil
		}); err != nil {
			return err
		}
	}

	server, err := c.Complete(nil).New("apiserver-shim", genericapiserver.NewEmptyDelegate())
	if err != nil {
		return fmt.Errorf("apiserver: %w", err)
	}
	stores, err := newStores(sch, c.RESTOptionsGetter)
	if err != nil {
		return err
	}
	group := genericapiserver.NewDefaultAPIGroupInfo("", sch.scheme, metav1.ParameterCodec, sch.codecs)
	group.VersionedResourcesStorageMap[corev1.SchemeGroupVersion.Version] = stores
	if err := server.InstallLegacyAPIGroup(genericapiserver.DefaultLegacyAPIPrefix, &group); err != nil {
		return fmt.Errorf("installing core/v1: %w", err)
	}
	if p, h := enc.statusPath(), enc.statusHandler(); p != "" && h != nil {
		server.Handler.NonGoRestfulMux.Handle(p, h)
	}
	logger.Info("Serving", "url", info.URL, "etcd", etcd.Servers, "etcdTLS", etcd.HasTLS(), "prefix", o.EtcdPrefix,
		"encryptionLayer", o.EncryptionLayer, "encryptionConfig", o.EncryptionConfig)
	return server.PrepareRun().RunWithContext(ctx)
}

// withMetrics serves GET /metrics from both the process-wide registry and reg, behind
// the same authentication and authorization as every other path.
func withMetrics(next http.Handler, reg metrics.KubeRegistry) http.Handler {
	merged := promhttp.HandlerFor(prometheus.Gatherers{legacyregistry.DefaultGatherer, reg},
		promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/metrics" && r.Method == http.MethodGet {
			merged.ServeHTTP(w, r)
			return
		}
		next.ServeHTTP(w, r)
	})
}
