package encryptionstate

import (
	"context"
	"fmt"
	"net/http"

	"k8s.io/apimachinery/pkg/api/equality"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metainternalversion "k8s.io/apimachinery/pkg/apis/meta/internalversion"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/validation/field"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/authentication/user"
	"k8s.io/apiserver/pkg/endpoints/handlers/responsewriters"
	"k8s.io/apiserver/pkg/endpoints/request"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/registry/generic/registry"
	"k8s.io/apiserver/pkg/registry/rest"
	"k8s.io/apiserver/pkg/storage/names"

	"github.com/rekey-io/rekey/api/v1alpha1"
)

// REST serves EncryptionState as a built-in resource of a k8s.io/apiserver server,
// stored in etcd like any other (every apiserver of the cluster serves and watches
// what the leader wrote), with get, list and watch only: discovery shows the verbs a
// user has, and the apiserver writes through Publisher, in its own process.
type REST struct {
	store *registry.Store
}

var (
	_ rest.Getter               = (*REST)(nil)
	_ rest.Lister               = (*REST)(nil)
	_ rest.Watcher              = (*REST)(nil)
	_ rest.Scoper               = (*REST)(nil)
	_ rest.SingularNameProvider = (*REST)(nil)
	_ rest.CategoriesProvider   = (*REST)(nil)
	_ rest.TableConvertor       = (*REST)(nil)
	_ Publisher                 = (*REST)(nil)
	_ rest.RESTCreateStrategy   = strategy{}
	_ rest.RESTUpdateStrategy   = strategy{}
	_ rest.RESTDeleteStrategy   = strategy{}
)

// NewREST builds the storage on getter (whose codec must store rekey.io/v1alpha1);
// typer is the server's scheme, table renders `kubectl get` (nil: name and age).
func NewREST(typer runtime.ObjectTyper, getter generic.RESTOptionsGetter, table rest.TableConvertor) (*REST, error) {
	s := strategy{ObjectTyper: typer, NameGenerator: names.SimpleNameGenerator}
	gr := v1alpha1.SchemeGroupVersion.WithResource(v1alpha1.EncryptionStateResource).GroupResource()
	store := &registry.Store{
		NewFunc:                   func() runtime.Object { return &v1alpha1.EncryptionState{} },
		NewListFunc:               func() runtime.Object { return &v1alpha1.EncryptionStateList{} },
		DefaultQualifiedResource:  gr,
		SingularQualifiedResource: v1alpha1.SchemeGroupVersion.WithResource("encryptionstate").GroupResource(),
		CreateStrategy:            s,
		UpdateStrategy:            s,
		DeleteStrategy:            s,
		TableConvertor:            table,
	}
	if table == nil {
		store.TableConvertor = rest.NewDefaultTableConvertor(gr)
	}
	if err := store.CompleteWithOptions(&generic.StoreOptions{RESTOptions: getter}); err != nil {
		return nil, fmt.Errorf("encryptionstates storage: %w", err)
	}
	return &REST{store: store}, nil
}

func (r *REST) New() runtime.Object     { return r.store.New() }
func (r *REST) NewList() runtime.Object { return r.store.NewList() }
func (r *REST) Destroy()                { r.store.Destroy() }
func (r *REST) NamespaceScoped() bool   { return false }
func (r *REST) GetSingularName() string { return "encryptionstate" }
func (r *REST) Categories() []string    { return []string{"rekey"} }
func (r *REST) Get(ctx context.Context, name string, o *metav1.GetOptions) (runtime.Object, error) {
	return r.store.Get(ctx, name, o)
}
func (r *REST) List(ctx context.Context, o *metainternalversion.ListOptions) (runtime.Object, error) {
	return r.store.List(ctx, o)
}
func (r *REST) Watch(ctx context.Context, o *metainternalversion.ListOptions) (watch.Interface, error) {
	return r.store.Watch(ctx, o)
}
func (r *REST) ConvertToTable(ctx context.Context, obj runtime.Object, opts runtime.Object) (*metav1.Table, error) {
	return r.store.ConvertToTable(ctx, obj, opts)
}

// Publish writes the cluster's object through the store, in this process: a
// compare-and-swap on the stored resourceVersion, so two apiservers that both believe
// they lead for a moment cannot interleave a stale status over a newer one unseen.
func (r *REST) Publish(ctx context.Context, st v1alpha1.EncryptionStateStatus) (bool, error) {
	// The store expects a request's context: a cluster-scoped object has the empty
	// namespace.
	ctx = request.WithNamespace(ctx, metav1.NamespaceNone)
	obj, err := r.store.Get(ctx, v1alpha1.EncryptionStateName, &metav1.GetOptions{})
	if apierrors.IsNotFound(err) {
		_, err := r.store.Create(ctx, &v1alpha1.EncryptionState{ObjectMeta: metav1.ObjectMeta{Name: v1alpha1.EncryptionStateName}, Status: st},
			rest.ValidateAllObjectFunc, &metav1.CreateOptions{})
		return err == nil, err
	}
	if err != nil {
		return false, err
	}
	cur := obj.(*v1alpha1.EncryptionState)
	if equality.Semantic.DeepEqual(cur.Status, st) {
		return false, nil
	}
	next := cur.DeepCopy()
	next.Status = st
	_, _, err = r.store.Update(ctx, next.Name, rest.DefaultUpdatedObjectInfo(next), rest.ValidateAllObjectFunc,
		rest.ValidateAllObjectUpdateFunc, false, &metav1.UpdateOptions{})
	return err == nil, err
}

// strategy: cluster-scoped, no validation beyond the metadata's (only the apiserver writes).
type strategy struct {
	runtime.ObjectTyper
	names.NameGenerator
}

func (strategy) NamespaceScoped() bool                                            { return false }
func (strategy) PrepareForCreate(context.Context, runtime.Object)                 {}
func (strategy) PrepareForUpdate(context.Context, runtime.Object, runtime.Object) {}
func (strategy) Validate(context.Context, runtime.Object) field.ErrorList         { return nil }
func (strategy) ValidateUpdate(context.Context, runtime.Object, runtime.Object) field.ErrorList {
	return nil
}
func (strategy) WarningsOnCreate(context.Context, runtime.Object) []string { return nil }
func (strategy) WarningsOnUpdate(context.Context, runtime.Object, runtime.Object) []string {
	return nil
}
func (strategy) Canonicalize(runtime.Object)                   {}
func (strategy) AllowCreateOnUpdate(context.Context) bool      { return false }
func (strategy) AllowUnconditionalUpdate(context.Context) bool { return false }

// RefuseWrites answers a write (create, update, patch, delete) of encryptionstates
// with 405 Method Not Allowed and what to do instead, unless allowed says the
// request's user may write (dist/kube-apiserver: its own loopback user, through which
// the leader writes). It belongs inside the handler chain, after authentication, so
// the user is known: a user without even read access still gets this answer, which
// names nothing stored.
func RefuseWrites(next http.Handler, codecs runtime.NegotiatedSerializer, allowed func(user.Info) bool) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		info, ok := request.RequestInfoFrom(r.Context())
		if ok && info.IsResourceRequest && info.APIGroup == v1alpha1.Group && info.Resource == v1alpha1.EncryptionStateResource && isWrite(info.Verb) {
			if u, ok := request.UserFrom(r.Context()); !ok || allowed == nil || !allowed(u) {
				err := apierrors.NewMethodNotSupported(v1alpha1.EncryptionStateGroupVersionResource().GroupResource(), info.Verb)
				err.ErrStatus.Message = fmt.Sprintf("%s.%s is read-only: rekey's migration leader keeps it current from its inventories of etcd; "+
					"read it with get, list or watch (to change what it shows, change the encryption configuration or run rekey migrate)",
					v1alpha1.EncryptionStateResource, v1alpha1.Group)
				responsewriters.ErrorNegotiated(err, codecs, v1alpha1.SchemeGroupVersion, w, r)
				return
			}
		}
		next.ServeHTTP(w, r)
	})
}

func isWrite(verb string) bool {
	switch verb {
	case "create", "update", "patch", "delete", "deletecollection":
		return true
	}
	return false
}
