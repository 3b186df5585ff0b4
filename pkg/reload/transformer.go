package reload

import (
	"context"
	"sync/atomic"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

var _ value.ResourceTransformers = (*Agent)(nil)

// TransformerForResource returns a transformer for gr that stays valid across reloads:
// every call loads the current configuration once and runs entirely on it.
func (a *Agent) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return &resourceTransformer{agent: a, gr: gr}
}

type resourceTransformer struct {
	agent *Agent
	gr    schema.GroupResource
	// bound remembers gr's chain in the generation it was looked up in, so a call pays
	// the resource lookup (a map keyed by two strings) only once per configuration.
	bound atomic.Pointer[boundChain]
}

type boundChain struct {
	gen   *generation
	chain *transformers.Chain
}

func (t *resourceTransformer) chain(g *generation) *transformers.Chain {
	if b := t.bound.Load(); b != nil && b.gen == g {
		return b.chain
	}
	c := g.set.TransformerFor(t.gr)
	t.bound.Store(&boundChain{gen: g, chain: c})
	return c
}

func (t *resourceTransformer) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	g := t.agent.acquire()
	defer g.release()
	return t.chain(g).TransformFromStorage(ctx, data, dataCtx)
}

func (t *resourceTransformer) TransformToStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, error) {
	if gate := t.agent.opts.WriteGate; gate != nil {
		if err := gate(); err != nil {
			return nil, err
		}
	}
	g := t.agent.acquire()
	defer g.release()
	return t.chain(g).TransformToStorage(ctx, data, dataCtx)
}

// Unavailable is the current configuration's answer for gr
// (transformers.UnavailableReporter): why a KMS plugin gr needs cannot be reached now.
func (t *resourceTransformer) Unavailable() error {
	g := t.agent.acquire()
	defer g.release()
	return t.chain(g).Unavailable()
}
