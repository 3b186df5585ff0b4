package layer

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes/fake"
	"k8s.io/client-go/tools/record"

	"github.com/rekey-io/rekey/pkg/events"
)

// The recorder sink posts about the Lease (APIServerLease: kube-system/<id>), with the kind as the event type, and cuts
// messages at 1 KiB.
func TestRecorderSink(t *testing.T) {
	fake := record.NewFakeRecorder(4)
	fake.IncludeObject = true
	s := recorderSink{rec: fake, involved: APIServerLease("apiserver-abc")}
	s.Event(events.Warning, events.ReasonStraggler, strings.Repeat("x", 5000))
	got := <-fake.Events
	if !strings.HasPrefix(got, "Warning EncryptionStraggler ") || !strings.Contains(got, "involvedObject{kind=Lease,apiVersion=coordination.k8s.io/v1}") {
		t.Errorf("event %q", got[:min(len(got), 200)])
	}
	if n := strings.Count(got, "x"); n > 1100 {
		t.Errorf("message of %d bytes, want it cut near 1 KiB", n)
	}
}

// A KMS key id is reported when it changes, not when a provider reports its first or
// a new provider the same one.
func TestKMSKeyIDChanges(t *testing.T) {
	var d events.Deferred
	k := &kmsKeyIDs{sink: &d}
	k.seen("vault", "sha256:aa")
	k.seen("vault", "sha256:aa")
	k.seen("vault", "sha256:bb")
	k.seen("other", "sha256:cc")
	fake := record.NewFakeRecorder(4)
	d.Attach(recorderSink{rec: fake, involved: APIServerLease("a")})
	if len(fake.Events) != 1 {
		t.Fatalf("%d events, want 1", len(fake.Events))
	}
	if got := <-fake.Events; !strings.Contains(got, "KMSKeyIDChanged") || !strings.Contains(got, "from sha256:aa to sha256:bb") {
		t.Errorf("event %q", got)
	}
}

// The events hook waits for the involved object's namespace: on a cluster's first start
// kube-system is created after the apiserver serves, and an Event posted before is
// refused for good.
func TestWaitForNamespace(t *testing.T) {
	client := fake.NewClientset()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- waitForNamespace(ctx, client.CoreV1(), "kube-system", 5*time.Millisecond) }()
	select {
	case err := <-done:
		t.Fatalf("returned (%v) before kube-system existed", err)
	case <-time.After(100 * time.Millisecond):
	}
	if _, err := client.CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: "kube-system"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	if err := <-done; err != nil {
		t.Fatalf("after kube-system was created: %v", err)
	}
	stopped, stop := context.WithCancel(t.Context())
	stop()
	if err := waitForNamespace(stopped, client.CoreV1(), "missing", 5*time.Millisecond); err == nil {
		t.Fatal("a cancelled wait for a missing namespace returned no error")
	}
}
