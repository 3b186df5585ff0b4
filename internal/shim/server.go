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
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/authentication/user"
	openapinamer "k8s.io/apiserver/pkg/endpoints/openapi"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/registry/rest"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	serverstorage "k8s.io/apiserver/pkg/server/storage"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/util/compatibility"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/metrics/legacyregistry"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/shim/openapi"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
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
	// Rekey are the encryption layer's own flags (pkg/layer), the same in
	// dist/kube-apiserver: the layer switch (--encryption-layer), KMS v2 timings,
	// storage migration, the applied state and cluster coordination. The zero value
	// keeps every default and leaves coordination off; the command starts from
	// layer.NewFlags(layer.ShimDefaults()). The upstream layer uses none but the switch.
	Rekey layer.Flags
	// KMS builds KMS v2 providers for the rekey layer; default kmsv2.NewFactory with
	// the KMS timings of Rekey.
	KMS transformers.KMSFactory

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
	if o.Rekey.EncryptionLayer == "" {
		o.Rekey.EncryptionLayer = layer.EncryptionLayerRekey
	}
	if err := errors.Join(o.Rekey.Validate()...); err != nil {
		return err
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
	if !o.Rekey.Rekey() && o.KMS != nil {
		o.KMS = nil // upstream builds its own KMS v2 clients
	}
	if o.Rekey.APIServerID == "" {
		o.Rekey.APIServerID = defaultAPIServerID(o.SecurePort)
	}
	return nil
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
	lo, err := rekeyLayerOptions(&o, reg, c.APIServerID)
	if err != nil {
		return err
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
	// The layer's one etcd client needs the address, and the write fence must know the
	// other apiservers before the first configuration is applied: the layer starts
	// after etcd (the file itself was checked before).
	lo.Etcd = etcd
	enc, err := newEncryptionLayer(ctx, &o, lo)
	if err != nil {
		return err
	}
	defer enc.close()
	if err := enc.checkStart(ctx); err != nil {
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
		// Inside authentication, so that a user's write of the read-only
		// encryptionstates is answered with what to do instead.
		return genericapiserver.DefaultBuildHandlerChain(encryptionstate.RefuseWrites(withMetrics(h, reg), sch.codecs, nil), c)
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
	if o.Rekey.Rekey() && o.EncryptionConfig != "" {
		if err := installEncryptionState(server, sch, c.RESTOptionsGetter, enc); err != nil {
			return err
		}
	}
	if p, h := enc.statusPath(), enc.statusHandler(); p != "" && h != nil {
		server.Handler.NonGoRestfulMux.Handle(p, h)
	}
	logger.Info("Serving", "url", info.URL, "etcd", etcd.Servers, "etcdTLS", etcd.HasTLS(), "prefix", o.EtcdPrefix,
		"encryptionLayer", o.Rekey.EncryptionLayer, "encryptionConfig", o.EncryptionConfig)
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

// installEncryptionState serves rekey.io/v1alpha1 encryptionstates as a built-in,
// read-only group, stored in etcd as JSON beside the Secrets (the layer's transformers
// apply to it as to any resource), and has the layer publish into it.
func installEncryptionState(server *genericapiserver.GenericAPIServer, sch *apiScheme, getter generic.RESTOptionsGetter, enc encryptionLayer) error {
	codec, versioner, err := serverstorage.NewStorageCodec(serverstorage.StorageCodecConfig{
		StorageMediaType:  runtime.ContentTypeJSON,
		StorageSerializer: sch.codecs,
		StorageVersion:    v1alpha1.SchemeGroupVersion,
		MemoryVersion:     schema.GroupVersion{Group: v1alpha1.Group, Version: runtime.APIVersionInternal},
	})
	if err != nil {
		return fmt.Errorf("encryptionstates storage codec: %w", err)
	}
	state, err := encryptionstate.NewREST(sch.scheme, codecGetter{RESTOptionsGetter: getter, codec: codec, versioner: versioner}, encryptionStateTable)
	if err != nil {
		return err
	}
	group := genericapiserver.NewDefaultAPIGroupInfo(v1alpha1.Group, sch.scheme, metav1.ParameterCodec, sch.codecs)
	group.VersionedResourcesStorageMap[v1alpha1.Version] = map[string]rest.Storage{v1alpha1.EncryptionStateResource: state}
	if err := server.InstallAPIGroup(&group); err != nil {
		return fmt.Errorf("installing %s: %w", v1alpha1.SchemeGroupVersion, err)
	}
	enc.publishEncryptionState(state)
	return nil
}

// codecGetter is a REST options getter whose storage encodes with codec: the server's
// storage codec stores core/v1 only.
type codecGetter struct {
	generic.RESTOptionsGetter
	codec     runtime.Codec
	versioner runtime.GroupVersioner
}

func (g codecGetter) GetRESTOptions(resource schema.GroupResource, example runtime.Object) (generic.RESTOptions, error) {
	o, err := g.RESTOptionsGetter.GetRESTOptions(resource, example)
	if err != nil {
		return o, err
	}
	sc := *o.StorageConfig
	sc.Codec, sc.EncodeVersioner = g.codec, g.versioner
	o.StorageConfig = &sc
	return o, nil
}
