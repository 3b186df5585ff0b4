package e2e

import (
	"context"
	"fmt"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	svmv1 "k8s.io/api/storagemigration/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/pkg/events"
)

// identityLease is the name of kube-apiserver's own identity Lease in kube-system: the
// object rekey's Events are about.
func identityLease(t *testing.T, cs kubernetes.Interface) string {
	t.Helper()
	var lease string
	eventually(t, 60*time.Second, 500*time.Millisecond, "the apiserver's identity Lease", func() error {
		l, err := cs.CoordinationV1().Leases("kube-system").List(t.Context(), metav1.ListOptions{LabelSelector: "apiserver.kubernetes.io/identity=kube-apiserver"})
		if err != nil {
			return err
		}
		if len(l.Items) != 1 {
			return fmt.Errorf("%d identity leases", len(l.Items))
		}
		lease = l.Items[0].Name
		return nil
	})
	return lease
}

// leaseEvents are the Events in kube-system about the Lease.
func leaseEvents(ctx context.Context, cs kubernetes.Interface, lease string) ([]corev1.Event, error) {
	l, err := cs.CoreV1().Events("kube-system").List(ctx, metav1.ListOptions{FieldSelector: "involvedObject.kind=Lease,involvedObject.name=" + lease})
	if err != nil {
		return nil, err
	}
	return l.Items, nil
}

// checkRotationEvents checks that a rotation on kube-apiserver with rekey showed in
// Kubernetes' own tools, as a client sees them: Events in kube-system about the
// apiserver's identity Lease for the configuration applied, the migration started and
// verified and the old key dropped (none holding any of secrets), and every migration
// mirrored as a storagemigration.k8s.io/v1 StorageVersionMigration that reached
// Succeeded (and no other state).
func checkRotationEvents(t *testing.T, cs kubernetes.Interface, lease, dropped string, secrets []string) {
	t.Helper()
	ctx := t.Context()
	var all []corev1.Event
	want := []string{events.ReasonConfigApplied, events.ReasonMigrationStarted, events.ReasonMigrationVerified, events.ReasonKeyDropped}
	eventually(t, 60*time.Second, 500*time.Millisecond, "the rotation's events", func() error {
		var err error
		if all, err = leaseEvents(ctx, cs, lease); err != nil {
			return err
		}
		got := map[string]bool{}
		for _, e := range all {
			got[e.Reason] = true
		}
		for _, r := range want {
			if !got[r] {
				return fmt.Errorf("no %s event; have %v", r, got)
			}
		}
		return nil
	})
	droppedNamed := false
	for _, e := range all {
		if e.Source.Component != "rekey" || e.InvolvedObject.Namespace != "kube-system" {
			t.Errorf("event %s: source %q about %s/%s, want rekey about kube-system/%s", e.Reason, e.Source.Component, e.InvolvedObject.Namespace, e.InvolvedObject.Name, lease)
		}
		for _, s := range secrets {
			if strings.Contains(e.Message, s) {
				t.Errorf("event %s holds key material: %q", e.Reason, e.Message)
			}
		}
		droppedNamed = droppedNamed || e.Reason == events.ReasonKeyDropped && strings.Contains(e.Message, dropped)
		t.Logf("event %s %s: %s", e.Type, e.Reason, e.Message)
	}
	if !droppedNamed {
		t.Errorf("no %s event names %s", events.ReasonKeyDropped, dropped)
	}
	l, err := cs.StoragemigrationV1().StorageVersionMigrations().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=rekey"})
	if err != nil {
		t.Fatal(err)
	}
	succeeded := 0
	for _, o := range l.Items {
		c := o.Status.Conditions
		switch {
		case meta.IsStatusConditionTrue(c, string(svmv1.MigrationSucceeded)) &&
			!meta.IsStatusConditionTrue(c, string(svmv1.MigrationRunning)) && !meta.IsStatusConditionTrue(c, string(svmv1.MigrationFailed)):
			succeeded++
		default:
			t.Errorf("mirrored migration %s of %s: conditions %+v, want Succeeded only", o.Name, o.Spec.Resource.Resource, c)
		}
	}
	if succeeded == 0 {
		t.Errorf("no mirrored StorageVersionMigration reached Succeeded (%d mirrored)", len(l.Items))
	}
}
