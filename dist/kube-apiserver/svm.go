package main

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	svmv1 "k8s.io/api/storagemigration/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	svmclient "k8s.io/client-go/kubernetes/typed/storagemigration/v1"
	"k8s.io/klog/v2"
)

// svmCallTimeout bounds each call of the mirror: it runs on the migration's goroutine.
const svmCallTimeout = 10 * time.Second

// Labels of the mirrored StorageVersionMigrations.
const (
	svmManagedByLabel = "app.kubernetes.io/managed-by"
	svmManagedBy      = "rekey"
)

// svmMirror mirrors each migration rekey's elected migrator runs as a
// storagemigration.k8s.io/v1 StorageVersionMigration (cluster.MigrationMirror): created
// with Running when it starts, Succeeded or Failed when it ends, so tooling that waits
// on that API (`kubectl wait --for=condition=Succeeded storageversionmigration/…`) sees
// rekey's migrations. The object only reports: rekey migrates. When the API is not
// served (the group disabled with --runtime-config) the mirror logs once at V(2) and
// does nothing; a failed call is logged and never fails the migration.
type svmMirror struct {
	client svmclient.StorageVersionMigrationInterface
	log    klog.Logger

	mu sync.Mutex
	// running is the object mirroring the running migration of each resource.
	running map[string]string
	// unserved is set once the API answered that it is not served.
	unserved bool
}

func newSVMMirror(client svmclient.StorageVersionMigrationInterface, log klog.Logger) *svmMirror {
	return &svmMirror{client: client, log: log.WithName("storage-version-migration"), running: map[string]string{}}
}

// Started creates the object of resource's migration and marks it Running.
func (m *svmMirror) Started(ctx context.Context, resource, target string) {
	if m.isUnserved() {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, svmCallTimeout)
	defer cancel()
	gr := schema.ParseGroupResource(resource)
	obj := &svmv1.StorageVersionMigration{
		ObjectMeta: metav1.ObjectMeta{
			GenerateName: svmNamePrefix(gr),
			Labels:       map[string]string{svmManagedByLabel: svmManagedBy},
		},
		Spec: svmv1.StorageVersionMigrationSpec{Resource: metav1.GroupResource{Group: gr.Group, Resource: gr.Resource}},
	}
	created, err := m.client.Create(ctx, obj, metav1.CreateOptions{FieldManager: svmManagedBy})
	if err != nil {
		m.failed(err, "create", resource)
		return
	}
	meta.SetStatusCondition(&created.Status.Conditions, metav1.Condition{Type: string(svmv1.MigrationRunning), Status: metav1.ConditionTrue,
		Reason: "RekeyMigrating", Message: "rekey re-encrypts the stored objects with " + target})
	if _, err := m.client.UpdateStatus(ctx, created, metav1.UpdateOptions{FieldManager: svmManagedBy}); err != nil {
		m.failed(err, "mark Running", resource)
	}
	m.mu.Lock()
	m.running[resource] = created.Name
	m.mu.Unlock()
}

// Finished marks the object of resource's migration Succeeded (err nil) or Failed.
func (m *svmMirror) Finished(ctx context.Context, resource string, migErr error) {
	m.mu.Lock()
	name, ok := m.running[resource]
	delete(m.running, resource)
	m.mu.Unlock()
	if !ok {
		return
	}
	ctx, cancel := context.WithTimeout(ctx, svmCallTimeout)
	defer cancel()
	obj, err := m.client.Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		m.failed(err, "read", resource)
		return
	}
	done := metav1.Condition{Type: string(svmv1.MigrationSucceeded), Status: metav1.ConditionTrue, Reason: "RekeyVerified",
		Message: "rekey migrated every stored object and verified it by a re-scan"}
	if migErr != nil {
		msg := migErr.Error()
		if len(msg) > 1024 {
			msg = msg[:1024]
		}
		done = metav1.Condition{Type: string(svmv1.MigrationFailed), Status: metav1.ConditionTrue, Reason: "RekeyFailed",
			Message: msg + " (rekey's leader retries in a new migration)"}
	}
	meta.SetStatusCondition(&obj.Status.Conditions, metav1.Condition{Type: string(svmv1.MigrationRunning), Status: metav1.ConditionFalse,
		Reason: done.Reason, Message: "finished"})
	meta.SetStatusCondition(&obj.Status.Conditions, done)
	if _, err := m.client.UpdateStatus(ctx, obj, metav1.UpdateOptions{FieldManager: svmManagedBy}); err != nil {
		m.failed(err, "mark "+done.Type, resource)
	}
}

func (m *svmMirror) isUnserved() bool {
	m.mu.Lock()
	defer m.mu.Unlock()
	return m.unserved
}

// failed logs a call that failed; an API that is not served is logged once, at V(2).
func (m *svmMirror) failed(err error, what, resource string) {
	if apierrors.IsNotFound(err) && what == "create" || meta.IsNoMatchError(err) {
		m.mu.Lock()
		first := !m.unserved
		m.unserved = true
		m.mu.Unlock()
		if first {
			m.log.V(2).Info("storagemigration.k8s.io/v1 is not served; rekey's migrations are not mirrored as StorageVersionMigrations", "err", err)
		}
		return
	}
	m.log.Error(err, "Could not mirror a storage migration as a StorageVersionMigration; the migration is not affected", "call", what, "resource", resource)
}

// svmNamePrefix is "rekey-<resource>[.<group>]-": a DNS subdomain the API server
// completes with a random suffix.
func svmNamePrefix(gr schema.GroupResource) string {
	name := strings.ToLower(gr.String())
	if len(name) > 200 {
		name = name[:200]
	}
	return fmt.Sprintf("rekey-%s-", strings.Trim(name, "."))
}
