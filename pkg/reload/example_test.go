package reload_test

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/reload"
)

// An apiserver builds the agent from its --encryption-provider-config file and installs
// it into its server config: the agent becomes the config's ResourceTransformers, and
// with automatic reload it adds the kms-providers check and the post-start hook that
// watches the file. A configuration with a `kms` provider also needs
// Options.Transformers.KMS (kmsv2.NewFactory).
func ExampleNewAgent() {
	dir, err := os.MkdirTemp("", "rekey-example")
	if err != nil {
		fmt.Println(err)
		return
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "encryption.yaml")
	if err := os.WriteFile(path, []byte(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: ["secrets"]
  providers:
  - aesgcm:
      keys:
      - name: key1
        secret: c2VjcmV0IGlzIHNlY3VyZSwgb3IgaXMgaXQ/IDMyYnk=
  - identity: {}
`), 0o600); err != nil {
		fmt.Println(err)
		return
	}

	ctx := context.Background()
	agent, err := reload.NewAgent(ctx, reload.Options{Path: path, AutomaticReload: true})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer agent.Close()
	serverConfig := genericapiserver.NewConfig(serializer.NewCodecFactory(runtime.NewScheme()))
	if err := agent.InstallInto(serverConfig); err != nil {
		fmt.Println(err)
		return
	}

	secrets := serverConfig.ResourceTransformers.TransformerForResource(schema.GroupResource{Resource: "secrets"})
	stored, err := secrets.TransformToStorage(ctx, []byte("plaintext"), value.DefaultContext("/registry/secrets/default/token"))
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("secrets are stored with prefix %q\n", stored[:len("k8s:enc:aesgcm:v1:key1:")])
	// Output:
	// secrets are stored with prefix "k8s:enc:aesgcm:v1:key1:"
}
