package shim

import (
	"context"
	"fmt"
	"net/http"

	genericapiserver "k8s.io/apiserver/pkg/server"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/reload"
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

func newEncryptionLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry, apiServerID string) (encryptionLayer, error) {
	switch o.EncryptionLayer {
	case "", LayerRekey:
		return newRekeyLayer(ctx, o, reg, apiServerID)
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

// rekeyLayer is the agent: it loads and watches the file, swaps configurations and
// serves the kms-providers check and the status document.
type rekeyLayer struct {
	agent *reload.Agent
}

func newRekeyLayer(ctx context.Context, o *Options, reg metrics.KubeRegistry, apiServerID string) (*rekeyLayer, error) {
	if o.EncryptionConfig == "" {
		return &rekeyLayer{}, nil
	}
	agent, err := reload.NewAgent(ctx, reload.Options{
		Path:            o.EncryptionConfig,
		AutomaticReload: o.AutomaticReload,
		PollInterval:    o.ReloadPollInterval,
		Transformers: transformers.Options{
			Logger:  o.Logger,
			Metrics: transformers.NewMetrics(reg),
			KMS:     kmsFactory(o, reg),
		},
		Registry:    reg,
		APIServerID: apiServerID,
		Logger:      o.Logger,
	})
	if err != nil {
		return nil, err
	}
	return &rekeyLayer{agent: agent}, nil
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

func (r *rekeyLayer) install(c *genericapiserver.Config, _ *genericoptions.EtcdOptions) error {
	if r.agent == nil {
		return nil
	}
	return r.agent.InstallInto(c)
}

func (r *rekeyLayer) statusPath() string {
	if r.agent == nil {
		return ""
	}
	return reload.StatusPath
}

func (r *rekeyLayer) statusHandler() http.Handler {
	if r.agent == nil {
		return nil
	}
	return r.agent.StatusHandler()
}

func (r *rekeyLayer) close() {
	if r.agent != nil {
		r.agent.Close()
	}
}
