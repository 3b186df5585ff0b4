package layer

import (
	"context"
	"errors"
	"fmt"
	"sync"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/watch"
	"k8s.io/apiserver/pkg/storage"
	"k8s.io/apiserver/pkg/storage/storagebackend/factory"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// The read side of refusedWritesStorage: reads that a KMS plugin's absence fails.
//
// A read that needs an unavailable plugin (transformers.ErrKMSUnavailable), including
// the read of the stored object an update or a delete makes first, is answered with 503 and the provider's own account of it (provider, endpoint, since when, why),
// not the 500 "corrupt object … not transformable" of the etcd3 store. Two answers of
// the watch cache are replaced while a KMS plugin of the resource is unavailable
// (transformers.UnavailableOf its transformer):
//   - a watch cache that cannot fill (its initial list needs the plugin) answers 429
//     "storage is (re)initializing" with a Retry-After that grows with the downtime,
//     naming no cause, and client-go repeats the request up to ten times: it becomes
//     the same 503;
//   - a watch cache stuck behind an event it cannot decrypt keeps its last state, and
//     a consistent LIST waits 3 s for it to catch up before it reads etcd: a
//     consistent LIST reads etcd at once instead (directStore), and succeeds when
//     every object's DEK is cached;
//   - once the plugin is back, the watch cache fills again within a second or so;
//     until then a consistent LIST of a resource that went through an outage reads
//     etcd instead of answering 429.
//
// None of these carries Retry-After: a read that cannot be served fails at once, and
// the client decides when to ask again.

func (s refusedWritesStorage) Get(ctx context.Context, key string, opts storage.GetOptions, objPtr runtime.Object) error {
	return s.readStatus(s.Interface.Get(ctx, key, opts, objPtr))
}

func (s refusedWritesStorage) GetList(ctx context.Context, key string, opts storage.ListOptions, listObj runtime.Object) error {
	if s.direct != nil && consistentList(opts) && transformers.UnavailableOf(s.tr) != nil {
		if d, err := s.direct.get(); err == nil {
			return s.readStatus(d.GetList(ctx, key, opts, listObj))
		}
		// No store of its own: the watch cache answers, as it would anyway.
	}
	err := s.Interface.GetList(ctx, key, opts, listObj)
	if apierrors.IsTooManyRequests(err) && s.direct != nil && consistentList(opts) {
		// The plugin is back but the watch cache has not filled again yet (it retries
		// its list every second): a resource that went through an outage reads etcd
		// rather than send the client into Retry-After waits.
		if d := s.direct.opened(); d != nil {
			return s.readStatus(d.GetList(ctx, key, opts, listObj))
		}
	}
	return s.readStatus(err)
}

// Delete reads the stored object before it removes it (preconditions, validation).
func (s refusedWritesStorage) Delete(ctx context.Context, key string, out runtime.Object, preconditions *storage.Preconditions,
	validateDeletion storage.ValidateObjectFunc, cachedExistingObject runtime.Object, opts storage.DeleteOptions,
) error {
	return s.readStatus(s.Interface.Delete(ctx, key, out, preconditions, validateDeletion, cachedExistingObject, opts))
}

func (s refusedWritesStorage) Watch(ctx context.Context, key string, opts storage.ListOptions) (watch.Interface, error) {
	w, err := s.Interface.Watch(ctx, key, opts)
	return w, s.readStatus(err)
}

// consistentList: a LIST that must see etcd's current revision (no resource version,
// no continue token); the watch cache serves it only once it has caught up.
func consistentList(opts storage.ListOptions) bool {
	return opts.ResourceVersion == "" && opts.ResourceVersionMatch == "" && opts.Predicate.Continue == ""
}

// readStatus is err, or a 503 naming the KMS provider whose unavailable plugin err
// (or, for a watch cache, the resource's transformer) says failed the read.
func (s refusedWritesStorage) readStatus(err error) error {
	if err == nil {
		return nil
	}
	if errors.Is(err, transformers.ErrKMSUnavailable) {
		return apierrors.NewServiceUnavailable(kmsUnavailableText(err))
	}
	// A LIST that found objects it could not read, with AllowUnsafeMalformedObjectDeletion's
	// aggregation (the etcd3 store's 500 StoreReadError, which wraps none of them).
	listed := apierrors.ReasonForError(err) == metav1.StatusReasonStoreReadError
	if s.tr == nil || !(listed || apierrors.IsTooManyRequests(err)) {
		return err
	}
	why := transformers.UnavailableOf(s.tr)
	switch {
	case why == nil:
		return err
	case listed:
		return apierrors.NewServiceUnavailable(fmt.Sprintf("some %s cannot be read: %s", s.gr, kmsUnavailableText(why)))
	}
	return apierrors.NewServiceUnavailable(fmt.Sprintf("the watch cache of %s cannot be filled: %s", s.gr, kmsUnavailableText(why)))
}

// kmsUnavailableText is the message of the innermost error of err's chain that still
// matches transformers.ErrKMSUnavailable: the provider's text, without the storage
// layer's "Internal error occurred" around it.
func kmsUnavailableText(err error) string {
	for {
		next := errors.Unwrap(err)
		if next == nil || !errors.Is(next, transformers.ErrKMSUnavailable) {
			return err.Error()
		}
		err = next
	}
}

// directStore is an etcd3 store of the resource past its watch cache, made the first
// time a consistent LIST needs it (during a KMS outage only: it holds an etcd client)
// and closed with the resource's storage.
type directStore struct {
	open func() (storage.Interface, factory.DestroyFunc, error)

	mu      sync.Mutex
	s       storage.Interface
	destroy factory.DestroyFunc
	closed  bool
}

func (d *directStore) get() (storage.Interface, error) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil, errors.New("the resource's storage is closed")
	}
	if d.s == nil {
		s, destroy, err := d.open()
		if err != nil {
			return nil, err
		}
		d.s, d.destroy = s, destroy
	}
	return d.s, nil
}

// opened is the store if an outage made it, nil otherwise.
func (d *directStore) opened() storage.Interface {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.closed {
		return nil
	}
	return d.s
}

func (d *directStore) close() {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.closed = true
	if d.destroy != nil {
		d.destroy()
	}
}
