package layer_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"github.com/spf13/pflag"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/storagebackend"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/layer"
)

// A custom apiserver declares the layer's flags beside its own, gives the layer what
// only the apiserver knows (the configuration file, its etcd, its identity), and calls
// the layer in its start-up order.
func Example() {
	dir, err := os.MkdirTemp("", "layer-example-")
	if err != nil {
		panic(err)
	}
	defer os.RemoveAll(dir)
	etcdURL, stopEtcd := startEtcd(dir) // the apiserver's storage backend
	defer stopEtcd()
	configPath := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(configPath, []byte(encryptionConfig), 0o600); err != nil {
		panic(err)
	}

	// The apiserver's own flags, then the layer's with this apiserver's defaults.
	fs := pflag.NewFlagSet("my-apiserver", pflag.ContinueOnError)
	path := fs.String("encryption-provider-config", "", "The EncryptionConfiguration file.")
	etcdServers := fs.StringSlice("etcd-servers", nil, "etcd servers to store in.")
	flags := layer.NewFlags(layer.Defaults{
		StorageMigration:   true,
		StorageResources:   []string{"secrets"},
		APIServerIDDefault: "my-apiserver's identity",
	})
	flags.AddFlags(fs)
	err = fs.Parse([]string{"--encryption-provider-config", configPath, "--etcd-servers", etcdURL,
		"--apiserver-id", "example-1", "--coordination-prefix", "/example-rekey"})
	if err != nil {
		panic(err)
	}
	if errs := flags.Validate(); len(errs) > 0 {
		panic(errs)
	}

	c := genericapiserver.NewConfig(serializer.NewCodecFactory(runtime.NewScheme()))
	opts := layer.Options{
		Flags:           flags,
		Path:            *path,
		AutomaticReload: true,
		Etcd:            layer.Etcd{Servers: *etcdServers},
		EtcdPrefix:      "/registry",
		Identity:        c.APIServerID,
	}

	ctx := context.Background()
	l, err := layer.New(ctx, opts) // makes the one etcd client; joins the cluster
	if err != nil {
		panic(err)
	}
	defer l.Close()
	if err := l.CheckStart(ctx); err != nil { // before anything is served
		panic(err)
	}
	// The apiserver's etcd options build its storage on the layer's transformers
	// (genericoptions.EtcdOptions.ApplyTo does this and more); the layer installs around it.
	etcd := genericoptions.NewEtcdOptions(storagebackend.NewDefaultConfig("/registry", nil))
	etcd.StorageConfig.Transport.ServerList = *etcdServers
	err = l.InstallInto(c, layer.Installation{Storage: func(c *genericapiserver.Config) error {
		c.RESTOptionsGetter = etcd.CreateRESTOptionsGetter(&genericoptions.SimpleStorageFactory{StorageConfig: etcd.StorageConfig}, c.ResourceTransformers)
		return nil
	}})
	if err != nil {
		panic(err)
	}
	// Then: build the server from c, and serve l.StatusHandler() at l.StatusPath().

	fmt.Println("transformers:", c.ResourceTransformers == l.Agent())
	fmt.Println("member:", opts.APIServerID, "coordinating:", opts.ClusterCoordination)
	fmt.Println("status:", l.StatusPath())
	// Output:
	// transformers: true
	// member: example-1 coordinating: true
	// status: /rekey/status
}

const encryptionConfig = `apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - aesgcm:
      keys: [{name: key1, secret: c2VjcmV0IGlzIHNlY3VyZSwgb3IgaXMgaXQ/Pz8/Pz8=}]
`

// startEtcd runs a single-member etcd in dir for the example (etcdtest: embedded, or a
// process under GODEBUG=fips140=only, where etcd cannot run in this process).
func startEtcd(dir string) (clientURL string, stop func()) {
	srv, err := etcdtest.New(filepath.Join(dir, "etcd"), etcdtest.Options{})
	if err != nil {
		panic(err)
	}
	return srv.Endpoint, srv.Close
}
