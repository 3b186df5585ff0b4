package layer_test

import (
	"context"
	"errors"
	"net/http"
	"strings"
	"testing"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/apiserver/pkg/storage/storagebackend/factory"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/client-go/tools/cache"

	"github.com/rekey-io/rekey/pkg/layer"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// readFailing fails every read with err, as the etcd3 store and the watch cache do.
type readFailing struct {
	storage.Interface
	err error
}

func (f readFailing) Get(context.Context, string, storage.GetOptions, runtime.Object) error {
	return f.err
}

func (f readFailing) GetList(context.Context, string, storage.ListOptions, runtime.Object) error {
	return f.err
}

func (f readFailing) Delete(context.Context, string, runtime.Object, *storage.Preconditions, storage.ValidateObjectFunc, runtime.Object, storage.DeleteOptions) error {
	return f.err
}

func (f readFailing) GuaranteedUpdate(context.Context, string, runtime.Object, bool, *storage.Preconditions, storage.UpdateFunc, runtime.Object) error {
	return f.err
}

func (f readFailing) Watch(context.Context, string, storage.ListOptions) (watch.Interface, error) {
	return nil, f.err
}

// reporting is a resource transformer that says whether a KMS plugin it needs is
// unavailable (transformers.UnavailableReporter), as the reload agent's do.
type reporting struct {
	value.Transformer
	unavailable error
}

func (r reporting) Unavailable() error { return r.unavailable }

// decoratedReads is the storage WithRefusedWrites builds around a store whose reads
// fail with err, for a resource whose transformer reports unavailable.
func decoratedReads(t *testing.T, err, unavailable error) storage.Interface {
	t.Helper()
	inner := generic.RESTOptions{Decorator: func(*storagebackend.ConfigForResource, string, func(runtime.Object) (string, error),
		func() runtime.Object, func() runtime.Object, storage.AttrFunc, storage.IndexerFuncs, *cache.Indexers,
	) (storage.Interface, factory.DestroyFunc, error) {
		return readFailing{err: err}, func() {}, nil
	}}
	o, gerr := layer.WithRefusedWrites(inner).GetRESTOptions(schema.GroupResource{Resource: "secrets"}, nil)
	if gerr != nil {
		t.Fatal(gerr)
	}
	cfg := &storagebackend.ConfigForResource{GroupResource: schema.GroupResource{Resource: "secrets"}}
	cfg.Transformer = reporting{unavailable: unavailable}
	s, destroy, gerr := o.Decorator(cfg, "/secrets", nil, nil, nil, nil, nil, nil)
	if gerr != nil {
		t.Fatal(gerr)
	}
	t.Cleanup(destroy)
	return s
}

// Reads that a KMS plugin's absence fails answer 503 with the provider's own text, not
// the store's 500, and carry no Retry-After (client-go would repeat them ten times);
// the watch cache's 429 and a LIST's StoreReadError become the same 503 only while
// the resource's transformer reports a plugin unavailable.
func TestReadsUnderAnUnavailablePluginAnswer503(t *testing.T) {
	const why = `kms v2 provider "kms1": the plugin at unix:///kms.sock is unavailable since 2031-05-06T07:08:09Z: connection refused`
	ctx := context.Background()
	down := transformers.Unavailable(errors.New(why))
	// Not consistent (a resource version): the watch cache answers, not etcd directly.
	cached := storage.ListOptions{ResourceVersion: "0"}
	notReady := apierrors.NewTooManyRequests("storage is (re)initializing", 1)
	storeRead := &apierrors.StatusError{ErrStatus: metav1.Status{Status: metav1.StatusFailure, Code: http.StatusInternalServerError,
		Reason: metav1.StatusReasonStoreReadError, Message: "failed to read one or more secrets from the storage: corrupt object"}}

	want503 := func(op string, err error) {
		t.Helper()
		var st *apierrors.StatusError
		if !errors.As(err, &st) || st.Status().Code != http.StatusServiceUnavailable || !strings.Contains(st.Status().Message, why) {
			t.Errorf("%s: %v, want a 503 with the provider's text", op, err)
			return
		}
		if strings.Contains(st.Status().Message, "Internal error") {
			t.Errorf("%s: %q keeps the store's wrapping", op, st.Status().Message)
		}
		if d := st.Status().Details; d != nil && d.RetryAfterSeconds != 0 {
			t.Errorf("%s: Retry-After %d on a read", op, d.RetryAfterSeconds)
		}
	}
	s := decoratedReads(t, storage.NewInternalError(down), nil)
	want503("Get", s.Get(ctx, "/secrets/ns/a", storage.GetOptions{}, nil))
	want503("GetList", s.GetList(ctx, "/secrets/ns", cached, nil))
	want503("Delete (reads the object first)", s.Delete(ctx, "/secrets/ns/a", nil, nil, nil, nil, storage.DeleteOptions{}))
	want503("GuaranteedUpdate (reads the object first)", s.GuaranteedUpdate(ctx, "/secrets/ns/a", nil, false, nil, nil, nil))

	s = decoratedReads(t, notReady, down)
	want503("GetList from a watch cache that cannot fill", s.GetList(ctx, "/secrets/ns", cached, nil))
	_, err := s.Watch(ctx, "/secrets/ns", cached)
	want503("Watch of a watch cache that cannot fill", err)
	want503("LIST with objects it cannot read", decoratedReads(t, storeRead, down).GetList(ctx, "/secrets/ns", cached, nil))

	// Nothing unavailable: the store's answers are the client's.
	if err := decoratedReads(t, notReady, nil).GetList(ctx, "/secrets/ns", cached, nil); !apierrors.IsTooManyRequests(err) {
		t.Errorf("GetList from a watch cache not ready for another reason: %v, want the 429 unchanged", err)
	}
	if err := decoratedReads(t, storeRead, nil).GetList(ctx, "/secrets/ns", cached, nil); apierrors.ReasonForError(err) != metav1.StatusReasonStoreReadError {
		t.Errorf("LIST of corrupt objects with every plugin up: %v, want the store's error unchanged", err)
	}
	other := storage.NewInternalError(errors.New("cipher: message authentication failed"))
	if err := decoratedReads(t, other, down).Get(ctx, "/secrets/ns/a", storage.GetOptions{}, nil); !storage.IsInternalError(err) {
		t.Errorf("Get of a value that does not decrypt: %v, want the store's error unchanged", err)
	}
}
