package shim

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"

	"k8s.io/apimachinery/pkg/runtime/schema"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/apiserver/pkg/server/healthz"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// Encryption layers the shim can run with.
const (
	// LayerRekey is the agent: rekey's config loader, transformers and reload.
	LayerRekey = "rekey"
	// LayerUpstream is k8s.io/apiserver's own encryptionconfig package, wired exactly as
	// kube-apiserver wires it; it exists for side-by-side benchmarks and interop tests.
	LayerUpstream = "upstream"
)

// encryptionLayer puts a way of transforming stored values into a server config.
type encryptionLayer interface {
	// install runs before etcd.ApplyTo: it sets c.ResourceTransformers and health
	// checks, or configures etcd to do so.
	install(c *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error
	// statusPath and statusHandler describe the layer's status document ("" when none).
	statusPath() string
	statusHandler() http.Handler
	close()
}

func newEncryptionLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry) (encryptionLayer, error) {
	switch o.EncryptionLayer {
	case "", LayerRekey:
		return newRekeyLayer(ctx, o, reg)
	case LayerUpstream:
		return &upstreamLayer{path: o.EncryptionConfig, reload: o.AutomaticReload}, nil
	default:
		return nil, fmt.Errorf("--encryption-layer=%q: must be %q or %q", o.EncryptionLayer, LayerRekey, LayerUpstream)
	}
}

// upstreamLayer leaves c.ResourceTransformers nil and hands the file to EtcdOptions,
// which loads it with encryptionconfig.LoadEncryptionConfig and installs its
// DynamicTransformers (reload on) or StaticTransformers, the kms-providers health
// check and the reload controller — kube-apiserver's own code path.
type upstreamLayer struct {
	path   string
	reload bool
}

func (u *upstreamLayer) install(_ *genericapiserver.Config, etcd *genericoptions.EtcdOptions) error {
	etcd.EncryptionProviderConfigFilepath = u.path
	etcd.EncryptionProviderConfigAutomaticReload = u.reload && u.path != ""
	return nil
}

func (u *upstreamLayer) statusPath() string          { return "" }
func (u *upstreamLayer) statusHandler() http.Handler { return nil }
func (u *upstreamLayer) close()                      {}

// rekeyLayer serves a Set built once at start.
// TODO(issue 5): replace with reload.Agent once pkg/reload lands.
type rekeyLayer struct {
	set *transformers.Set
}

// StatusPath is where the shim serves the encryption layer's status document.
const StatusPath = "/rekey/status"

func newRekeyLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry) (*rekeyLayer, error) {
	if o.EncryptionConfig == "" {
		return &rekeyLayer{}, nil
	}
	cfg, err := config.Load(o.EncryptionConfig, config.Options{Reload: o.AutomaticReload})
	if err != nil {
		return nil, err
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{
		Logger:  o.Logger,
		Metrics: transformers.NewMetrics(reg),
		KMS:     kmsFactory(o, reg),
	})
	if err != nil {
		return nil, fmt.Errorf("encryption provider configuration %q: %w", o.EncryptionConfig, err)
	}
	return &rekeyLayer{set: set}, nil
}

func kmsFactory(o *Options, reg metrics.KubeRegistry) transformers.KMSFactory {
	if o.KMS != nil {
		return o.KMS
	}
	return kmsv2.NewFactory(kmsv2.FactoryOptions{
		Registry:       reg,
		StatusInterval: o.KMSTimings.StatusInterval,
		RetryInterval:  o.KMSTimings.RetryInterval,
		WriteTTL:       o.KMSTimings.WriteTTL,
	})
}

type setTransformers struct{ set *transformers.Set }

func (s setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return s.set.TransformerFor(gr)
}

func (r *rekeyLayer) install(c *genericapiserver.Config, _ *genericoptions.EtcdOptions) error {
	if r.set == nil {
		return nil
	}
	c.ResourceTransformers = setTransformers{r.set}
	check := healthz.NamedCheck("kms-providers", func(req *http.Request) error {
		var errs []error
		for _, k := range r.set.KMSProviders() {
			if err := k.Check(req.Context()); err != nil {
				errs = append(errs, fmt.Errorf("kms provider %q: %w", k.Name(), err))
			}
		}
		return errors.Join(errs...)
	})
	c.HealthzChecks = append(c.HealthzChecks, check)
	c.ReadyzChecks = append(c.ReadyzChecks, check)
	return nil
}

func (r *rekeyLayer) statusPath() string { return StatusPath }

func (r *rekeyLayer) statusHandler() http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, _ *http.Request) {
		doc := map[string]any{"configHash": "", "rules": []transformers.RuleInfo{}}
		if r.set != nil {
			doc["configHash"] = r.set.Hash()
			doc["rules"] = r.set.Rules()
		}
		w.Header().Set("Content-Type", "application/json")
		_ = json.NewEncoder(w).Encode(doc)
	})
}

func (r *rekeyLayer) close() {
	if r.set != nil {
		r.set.Close()
	}
}
