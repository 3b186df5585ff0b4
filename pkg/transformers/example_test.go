package transformers_test

import (
	"context"
	"fmt"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Build turns a validated configuration into the transformers of every resource. A
// configuration with a `kms` provider also needs Options.KMS (kmsv2.NewFactory).
func ExampleBuild() {
	ctx := context.Background()
	cfg, err := config.Parse([]byte(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: ["secrets"]
  providers:
  - aesgcm:
      keys:
      - name: key1
        secret: c2VjcmV0IGlzIHNlY3VyZSwgb3IgaXMgaXQ/IDMyYnk=
  - identity: {}
`), "example.yaml", config.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{})
	if err != nil {
		fmt.Println(err)
		return
	}
	defer set.Close()

	secrets := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	key := value.DefaultContext("/registry/secrets/default/token")
	stored, err := secrets.TransformToStorage(ctx, []byte("plaintext"), key)
	if err != nil {
		fmt.Println(err)
		return
	}
	fmt.Printf("stored with prefix %q\n", stored[:len("k8s:enc:aesgcm:v1:key1:")])
	plain, stale, err := secrets.TransformFromStorage(ctx, stored, key)
	fmt.Printf("read back %q, stale=%v, err=%v\n", plain, stale, err)
	// Output:
	// stored with prefix "k8s:enc:aesgcm:v1:key1:"
	// read back "plaintext", stale=false, err=<nil>
}
