package e2e

import (
	"fmt"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	svmv1 "k8s.io/api/storagemigration/v1"
	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/events"
)

// A key rotation on dist/kube-apiserver shows in Kubernetes' own tools: the reload that
// promotes key2, the migration it triggers and the reload that drops key1 are Events
// in kube-system about the apiserver's identity Lease, and the migration is mirrored
// as a storagemigration.k8s.io/v1 StorageVersionMigration that reaches Succeeded. No
// event holds key material.
func TestKubeAPIServerRotationEvents(t *testing.T) {
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, configOf(rule("secrets", aesgcm("key1", key1), identity)))
	s := startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: "kapi-events", Dir: filepath.Join(dir, "kapi"),
		EtcdPrefix: uniquePrefix(t), EncryptionConfig: config, AutomaticReload: true,
		Args: []string{"--encryption-provider-config-poll-interval", "1s",
			"--storage-migration-check-interval", "1s", "--storage-inventory-interval", "2s"}})
	cs := clientFor(t, s)
	ns := "kapi-events"
	if _, err := cs.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	for i := range 5 {
		sec := &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: fmt.Sprintf("s%d", i)}, StringData: map[string]string{"v": "events-plaintext"}}
		if _, err := cs.CoreV1().Secrets(ns).Create(ctx, sec, metav1.CreateOptions{}); err != nil {
			t.Fatal(err)
		}
	}

	// The identity Lease the events are about: kube-apiserver's own, in kube-system.
	var lease string
	eventually(t, 60*time.Second, 500*time.Millisecond, "the apiserver's identity Lease", func() error {
		l, err := cs.CoordinationV1().Leases("kube-system").List(ctx, metav1.ListOptions{LabelSelector: "apiserver.kubernetes.io/identity=kube-apiserver"})
		if err != nil {
			return err
		}
		if len(l.Items) != 1 {
			return fmt.Errorf("%d identity leases", len(l.Items))
		}
		lease = l.Items[0].Name
		return nil
	})

	start := time.Now()
	writeConfig(t, config, configOf(rule("secrets", aesgcm("key2", key2), aesgcm("key1", key1), identity)))
	reasons := func() ([]corev1.Event, map[string]bool, error) {
		l, err := cs.CoreV1().Events("kube-system").List(ctx, metav1.ListOptions{
			FieldSelector: "involvedObject.kind=Lease,involvedObject.name=" + lease})
		if err != nil {
			return nil, nil, err
		}
		got := map[string]bool{}
		for _, e := range l.Items {
			got[e.Reason] = true
		}
		return l.Items, got, nil
	}
	want := []string{events.ReasonConfigApplied, events.ReasonMigrationStarted, events.ReasonMigrationVerified}
	eventually(t, 90*time.Second, 500*time.Millisecond, "events of the rotation", func() error {
		_, got, err := reasons()
		if err != nil {
			return err
		}
		for _, r := range want {
			if !got[r] {
				return fmt.Errorf("no %s event yet; have %v", r, got)
			}
		}
		return nil
	})
	t.Logf("rotation events seen %v after the configuration was written", time.Since(start).Round(time.Millisecond))

	var svm svmv1.StorageVersionMigration
	eventually(t, 30*time.Second, 500*time.Millisecond, "a Succeeded StorageVersionMigration of secrets", func() error {
		l, err := cs.StoragemigrationV1().StorageVersionMigrations().List(ctx, metav1.ListOptions{LabelSelector: "app.kubernetes.io/managed-by=rekey"})
		if err != nil {
			return err
		}
		for _, o := range l.Items {
			if o.Spec.Resource.Resource == "secrets" && meta.IsStatusConditionTrue(o.Status.Conditions, string(svmv1.MigrationSucceeded)) {
				svm = o
				return nil
			}
		}
		return fmt.Errorf("%d mirrored migrations, none of secrets Succeeded: %+v", len(l.Items), l.Items)
	})
	if meta.IsStatusConditionTrue(svm.Status.Conditions, string(svmv1.MigrationRunning)) ||
		meta.IsStatusConditionTrue(svm.Status.Conditions, string(svmv1.MigrationFailed)) {
		t.Errorf("%s: Succeeded with Running or Failed still true: %+v", svm.Name, svm.Status.Conditions)
	}

	// Dropping key1 once the migration is verified: the guard lets it go, an event says so.
	writeConfig(t, config, configOf(rule("secrets", aesgcm("key2", key2), identity)))
	eventually(t, 60*time.Second, 500*time.Millisecond, "the key dropped event", func() error {
		_, got, err := reasons()
		if err != nil {
			return err
		}
		if !got[events.ReasonKeyDropped] {
			return fmt.Errorf("no %s event yet; have %v", events.ReasonKeyDropped, got)
		}
		return nil
	})

	all, _, err := reasons()
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range all {
		if e.Source.Component != "rekey" || e.InvolvedObject.Namespace != "kube-system" {
			t.Errorf("event %s: source %q about %s/%s, want rekey about kube-system/%s", e.Reason, e.Source.Component, e.InvolvedObject.Namespace, e.InvolvedObject.Name, lease)
		}
		for _, secret := range []string{key1, key2, "events-plaintext"} {
			if strings.Contains(e.Message, secret) {
				t.Errorf("event %s holds key material or plaintext: %q", e.Reason, e.Message)
			}
		}
		t.Logf("event %s %s: %s", e.Type, e.Reason, e.Message)
	}
	if !slices.ContainsFunc(all, func(e corev1.Event) bool {
		return e.Reason == events.ReasonKeyDropped && strings.Contains(e.Message, "aesgcm/key1")
	}) {
		t.Errorf("no key dropped event names aesgcm/key1")
	}
}
