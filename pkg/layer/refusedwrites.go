package layer

import (
	"context"
	"errors"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/storage/storagebackend/factory"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/client-go/tools/cache"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// WithRefusedWrites returns a RESTOptionsGetter whose storage answers a write that a
// write fence refuses with the refusal's own 503 ServiceUnavailable status
// (transformers.WriteRefusedError), not the 500 the etcd3 store's wrapping of every
// transformer error would give, and a read that a KMS plugin's absence fails with a 503
// naming the provider and the cause (see refusedWritesStorage). Every other result is
// the inner storage's. InstallInto applies it to the config's getter; a binary that
// builds other getters on the same transformers (kube-apiserver's apiextensions and
// aggregator servers) applies it to those.
func WithRefusedWrites(g generic.RESTOptionsGetter) generic.RESTOptionsGetter {
	if g == nil {
		return nil
	}
	if _, done := g.(refusedWritesGetter); done {
		return g
	}
	return refusedWritesGetter{g}
}

type refusedWritesGetter struct{ generic.RESTOptionsGetter }

func (g refusedWritesGetter) GetRESTOptions(gr schema.GroupResource, example runtime.Object) (generic.RESTOptions, error) {
	o, err := g.RESTOptionsGetter.GetRESTOptions(gr, example)
	if err != nil {
		return o, err
	}
	inner := o.Decorator
	if inner == nil {
		inner = generic.UndecoratedStorage
	}
	o.Decorator = func(config *storagebackend.ConfigForResource, resourcePrefix string, keyFunc func(obj runtime.Object) (string, error),
		newFunc, newListFunc func() runtime.Object, getAttrs storage.AttrFunc, trigger storage.IndexerFuncs, indexers *cache.Indexers,
	) (storage.Interface, factory.DestroyFunc, error) {
		s, destroy, err := inner(config, resourcePrefix, keyFunc, newFunc, newListFunc, getAttrs, trigger, indexers)
		if err != nil {
			return s, destroy, err
		}
		rs := refusedWritesStorage{Interface: s, gr: gr}
		if config != nil {
			rs.tr = config.Transformer
			rs.direct = &directStore{open: func() (storage.Interface, factory.DestroyFunc, error) {
				return generic.NewRawStorage(config, newFunc, newListFunc, resourcePrefix)
			}}
			inner := destroy
			destroy = func() {
				inner()
				rs.direct.close()
			}
		}
		return rs, destroy, nil
	}
	return o, nil
}

// refusedWritesStorage is a storage.Interface whose Create and GuaranteedUpdate answer
// a refused write with its status. Those are the only calls that encrypt: Delete
// reads and removes without TransformToStorage (a graceful or finalizer deletion that
// updates goes through GuaranteedUpdate).
//
// It also answers reads that a KMS plugin's absence fails (kmsreads.go).
type refusedWritesStorage struct {
	storage.Interface
	gr schema.GroupResource
	// tr is the resource's transformer (the reload agent's), asked whether a KMS
	// plugin it needs is unavailable; nil when unknown.
	tr value.Transformer
	// direct reads etcd past the watch cache while a KMS plugin is unavailable; nil
	// when unknown.
	direct *directStore
}

func (s refusedWritesStorage) Create(ctx context.Context, key string, obj, out runtime.Object, ttl uint64) error {
	return refusalStatus(s.Interface.Create(ctx, key, obj, out, ttl))
}

func (s refusedWritesStorage) GuaranteedUpdate(ctx context.Context, key string, destination runtime.Object, ignoreNotFound bool,
	preconditions *storage.Preconditions, tryUpdate storage.UpdateFunc, cachedExistingObject runtime.Object,
) error {
	// An update reads the stored object first: a read the plugin's absence fails is
	// answered as a read is.
	return s.readStatus(refusalStatus(s.Interface.GuaranteedUpdate(ctx, key, destination, ignoreNotFound, preconditions, tryUpdate, cachedExistingObject)))
}

// refusalStatus is err, or the status of the write refusal err wraps. The REST layer
// passes a *StatusError through unchanged (storeerr's Interpret*Error only rewrite
// storage errors).
func refusalStatus(err error) error {
	var refused *transformers.WriteRefusedError
	if err == nil || !errors.As(err, &refused) {
		return err
	}
	return &apierrors.StatusError{ErrStatus: refused.Status()}
}
