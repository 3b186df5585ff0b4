package bench

import (
	"context"
	"fmt"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
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
