package reload

import (
	"context"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
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
}

func (t *resourceTransformer) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	g := t.agent.acquire()
	defer g.release()
	return g.set.TransformerFor(t.gr).TransformFromStorage(ctx, data, dataCtx)
}

func (t *resourceTransformer) TransformToStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, error) {
	g := t.agent.acquire()
	defer g.release()
	return g.set.TransformerFor(t.gr).TransformToStorage(ctx, data, dataCtx)
}
