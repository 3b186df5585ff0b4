package transformers_test

import (
	"context"
	"errors"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// downKMS is a KMS provider whose plugin is unavailable (transformers.UnavailableReporter)
// while down is set.
type downKMS struct {
	transformers.KMSProvider
	name string
	down error
}

func (k *downKMS) Prefix() []byte {
	return []byte(transformers.KeyPrefix(transformers.KMSv2Prefix, k.name))
}
func (k *downKMS) Name() string       { return k.name }
func (k *downKMS) Unavailable() error { return k.down }
func (k *downKMS) Close()             {}

// A rule's chain reports the first of its KMS providers whose plugin is unavailable,
// whatever its position (a provider kept only to read counts too), and nil when every
// plugin is reachable; transformers.UnavailableOf asks any transformer that can tell.
func TestChainReportsAnUnavailableKMSPlugin(t *testing.T) {
	kms := map[string]*downKMS{}
	opts := transformers.Options{KMS: func(_ context.Context, c *apiserver.KMSConfiguration, _ transformers.Options) (transformers.KMSProvider, error) {
		k := &downKMS{name: c.Name}
		kms[c.Name] = k
		return k, nil
	}}
	cfg := parseSecretsRule(t, `
  - aesgcm:
      keys: [{name: k1, secret: "c2VjcmV0IGlzIHNlY3VyZSwgc2VjcmV0IGlzIHNlY3U="}]
  - kms: {apiVersion: v2, name: old, endpoint: "unix:///old.sock"}
`)
	set, err := transformers.Build(context.Background(), cfg, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer set.Close()
	chain := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	var tr value.Transformer = chain
	if err := transformers.UnavailableOf(tr); err != nil {
		t.Fatalf("every plugin reachable: %v", err)
	}
	why := transformers.Unavailable(errors.New(`kms v2 provider "old": the plugin at unix:///old.sock is unavailable`))
	kms["old"].down = why
	if err := transformers.UnavailableOf(tr); !errors.Is(err, transformers.ErrKMSUnavailable) || err.Error() != why.Error() {
		t.Fatalf("the read-only provider's plugin down: %v, want %v", err, why)
	}
	if err := transformers.UnavailableOf(set.TransformerFor(schema.GroupResource{Resource: "configmaps"})); err != nil {
		t.Errorf("a resource without KMS: %v", err)
	}
}
