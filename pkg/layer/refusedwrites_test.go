package layer_test

import (
	"context"
	"errors"
	"net/http"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/storage"
	storeerr "k8s.io/apiserver/pkg/storage/errors"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/storage/storagebackend/factory"
	"k8s.io/client-go/tools/cache"

	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// failingStorage fails every call it implements with err, as the etcd3 store does when
// its transformer fails.
type failingStorage struct {
	storage.Interface
	err error
}

func (f failingStorage) Create(context.Context, string, runtime.Object, runtime.Object, uint64) error {
	return f.err
}

func (f failingStorage) GuaranteedUpdate(context.Context, string, runtime.Object, bool, *storage.Preconditions, storage.UpdateFunc, runtime.Object) error {
	return f.err
}

func (f failingStorage) Get(context.Context, string, storage.GetOptions, runtime.Object) error {
	return f.err
}

// decorated is the storage WithRefusedWrites builds around a store failing with err.
func decorated(t *testing.T, err error) storage.Interface {
	t.Helper()
	inner := generic.RESTOptions{Decorator: func(*storagebackend.ConfigForResource, string, func(runtime.Object) (string, error),
		func() runtime.Object, func() runtime.Object, storage.AttrFunc, storage.IndexerFuncs, *cache.Indexers,
	) (storage.Interface, factory.DestroyFunc, error) {
		return failingStorage{err: err}, func() {}, nil
	}}
	o, gerr := layer.WithRefusedWrites(inner).GetRESTOptions(schema.GroupResource{Resource: "secrets"}, nil)
	if gerr != nil {
		t.Fatal(gerr)
	}
	s, _, gerr := o.Decorator(nil, "", nil, nil, nil, nil, nil, nil)
	if gerr != nil {
		t.Fatal(gerr)
	}
	return s
}

// TestWithRefusedWritesAnswers503: a write refusal wrapped by the etcd3 store comes out
// of Create and GuaranteedUpdate as the refusal's 503 status, which the REST layer's
// error interpretation passes through unchanged; reads and other errors are untouched.
func TestWithRefusedWritesAnswers503(t *testing.T) {
	const why = "writes of secrets are refused: this apiserver's encryption configuration cannot read aesgcm/k2"
	ctx := context.Background()
	gr := schema.GroupResource{Resource: "secrets"}
	wrapped := storage.NewInternalError(&transformers.WriteRefusedError{Reason: why})
	s := decorated(t, wrapped)

	check := func(op string, err error) {
		t.Helper()
		var st *apierrors.StatusError
		if !errors.As(err, &st) || st.Status().Code != http.StatusServiceUnavailable || st.Status().Message != why || !apierrors.IsServiceUnavailable(err) {
			t.Errorf("%s: %v, want a 503 status with the refusal's message", op, err)
		}
	}
	createErr := s.Create(ctx, "/registry/secrets/ns/a", nil, nil, 0)
	check("Create", createErr)
	check("Create through the REST layer", storeerr.InterpretCreateError(createErr, gr, "a"))
	updateErr := s.GuaranteedUpdate(ctx, "/registry/secrets/ns/a", nil, false, nil, nil, nil)
	check("GuaranteedUpdate", updateErr)
	check("GuaranteedUpdate through the REST layer", storeerr.InterpretUpdateError(updateErr, gr, "a"))

	if err := s.Get(ctx, "/registry/secrets/ns/a", storage.GetOptions{}, nil); !storage.IsInternalError(err) {
		t.Errorf("Get: %v, want the store's error unchanged", err)
	}
	other := storage.NewInternalError(errors.New("kms plugin unavailable"))
	if err := decorated(t, other).Create(ctx, "/registry/secrets/ns/a", nil, nil, 0); !storage.IsInternalError(err) {
		t.Errorf("Create failing otherwise: %v, want the store's error unchanged", err)
	}
}
