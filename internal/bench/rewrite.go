package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// What the rotation and scale scenarios share of upstream's rewrite of every Secret.

// rewriteWorkers is the upstream script's concurrency for the no-op updates, as an
// operator's `xargs -P 8` around kubectl would run.
const rewriteWorkers = 8

type secretClient interface {
	Get(ctx context.Context, name string, opts metav1.GetOptions) (*corev1.Secret, error)
	Update(ctx context.Context, s *corev1.Secret, opts metav1.UpdateOptions) (*corev1.Secret, error)
}

// noopUpdate reads name and writes it back unchanged, retrying conflicts; it returns
// the number of conflicts.
func noopUpdate(ctx context.Context, secrets secretClient, name string) (int64, error) {
	var conflicts int64
	for attempt := 0; attempt < 20; attempt++ {
		cur, err := secrets.Get(ctx, name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return conflicts, nil // deleted since the list: nothing to rewrite
		}
		if err != nil {
			return conflicts, err
		}
		_, err = secrets.Update(ctx, cur, metav1.UpdateOptions{})
		if err == nil {
			return conflicts, nil
		}
		if !apierrors.IsConflict(err) {
			return conflicts, err
		}
		conflicts++
	}
	return conflicts, fmt.Errorf("%d conflicts in a row", conflicts)
}

// rewriteTally counts the upstream script's no-op updates of every Secret.
type rewriteTally struct{ rewritten, conflicts int64 }

// rewriteSecrets does what `kubectl get secrets -A -o json | kubectl replace -f -`
// does, with rewriteWorkers requests in flight spread over the apiservers as a load
// balancer would: it lists every Secret, then reads and writes back each one
// unchanged, re-reading after a conflict (a writer got there first). An unchanged
// update is stored again because its stored value was read with a key that no longer
// writes.
func rewriteSecrets(ctx context.Context, fleet *testbed.Fleet) (rewritten, conflicts int64, err error) {
	eps := fleet.Endpoints()
	clients := make([]kubernetes.Interface, len(eps))
	for i, ep := range eps {
		if clients[i], err = ep.Client(); err != nil {
			return 0, 0, err
		}
	}
	type ref struct{ ns, name string }
	var all []ref
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := clients[0].CoreV1().Secrets(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return 0, 0, fmt.Errorf("listing Secrets: %w", err)
		}
		for _, s := range l.Items {
			all = append(all, ref{s.Namespace, s.Name})
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	var next, done, conf atomic.Int64
	errs := make([]error, rewriteWorkers)
	var wg sync.WaitGroup
	for w := range rewriteWorkers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(all) || ctx.Err() != nil {
					return
				}
				secrets := clients[i%len(clients)].CoreV1().Secrets(all[i].ns)
				c, err := noopUpdate(ctx, secrets, all[i].name)
				conf.Add(c)
				if err != nil {
					errs[w] = fmt.Errorf("rewriting %s/%s: %w", all[i].ns, all[i].name, err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	return done.Load(), conf.Load(), errors.Join(errs...)
}
