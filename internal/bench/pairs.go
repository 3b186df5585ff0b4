package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// secretsGR is the resource every scenario encrypts.
var secretsGR = schema.GroupResource{Resource: "secrets"}

// LocalPair is one configuration built by upstream's LoadEncryptionConfig and by rekey.
type LocalPair struct {
	Upstream value.Transformer
	Rekey    value.Transformer
	close    func()
}

// Close releases both.
func (p *LocalPair) Close() { p.close() }

// BuildPair writes yaml to a temp file and builds it both ways for resource "secrets".
func BuildPair(yaml string, opts transformers.Options) (*LocalPair, error) {
	dir, err := os.MkdirTemp("", "rekey-bench")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	path := filepath.Join(dir, "config.yaml")
	if err := os.WriteFile(path, []byte(yaml), 0o600); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	up, err := encryptionconfig.LoadEncryptionConfig(ctx, path, false, "bench")
	if err != nil {
		cancel()
		return nil, fmt.Errorf("upstream: %w", err)
	}
	cfg, err := config.Load(path, config.Options{})
	if err != nil {
		cancel()
		return nil, err
	}
	set, err := transformers.Build(ctx, cfg, opts)
	if err != nil {
		cancel()
		return nil, err
	}
	return &LocalPair{
		Upstream: encryptionconfig.StaticTransformers(up.Transformers).TransformerForResource(secretsGR),
		Rekey:    set.TransformerFor(secretsGR),
		close:    func() { set.Close(); cancel() },
	}, nil
}
