package layer

import (
	"context"
	"errors"
	"fmt"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/util/wait"
	genericapiserver "k8s.io/apiserver/pkg/server"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/tools/record"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/guard"
)

// EventsHookName is the post-start hook that starts posting the layer's events.
const EventsHookName = "start-rekey-events"

// EventComponent is the source.component of the layer's events.
const EventComponent = "rekey"

// APIServerLease is kube-apiserver's identity Lease (kube-system/<APIServerID>, the
// Lease the apiserver identity controller keeps): what the layer's events are about in
// the distribution, so `kubectl get events -n kube-system
// --field-selector involvedObject.name=<id>` lists one apiserver's.
func APIServerLease(apiserverID string) *corev1.ObjectReference {
	return &corev1.ObjectReference{APIVersion: "coordination.k8s.io/v1", Kind: "Lease", Namespace: "kube-system", Name: apiserverID}
}

// addEventsHook posts the layer's events as core/v1 Events about involved, through a
// client-go event recorder on c's loopback client (rate-limited and aggregated by
// client-go's correlator). The recorder starts in a post-start hook, once the
// loopback client is served; events from before (the first configuration, the
// cluster node's first decisions) are kept, up to events.DefaultBuffer, and posted
// then. Without this hook (the apiserver shim, which serves no Events) nothing is
// posted: every event's fact is in the layer's log too.
func (l *Layer) addEventsHook(c *genericapiserver.Config, involved *corev1.ObjectReference) error {
	if l.agent == nil {
		return nil
	}
	return c.AddPostStartHook(EventsHookName, func(hc genericapiserver.PostStartHookContext) error {
		client, err := corev1client.NewForConfig(hc.LoopbackClientConfig)
		if err != nil {
			return fmt.Errorf("encryption layer events: %w", err)
		}
		go func() {
			// On a cluster's first start the involved object's namespace (kube-system) is
			// created by another post-start hook, maybe after this one: an Event posted
			// before it is refused for good ("namespaces kube-system not found (will
			// not retry!)"). Events stay buffered until the namespace exists.
			if err := waitForNamespace(hc.Context, client, involved.Namespace, namespacePollInterval); err != nil {
				return
			}
			b := record.NewBroadcaster(record.WithContext(hc.Context), record.WithCorrelatorOptions(eventCorrelation()))
			b.StartRecordingToSink(&corev1client.EventSinkImpl{Interface: client.Events("")})
			rec := b.NewRecorder(runtime.NewScheme(), corev1.EventSource{Component: EventComponent, Host: l.opts.Identity})
			if dropped := l.events.Attach(recorderSink{rec: rec, involved: involved}); dropped > 0 {
				l.log.Info("Events from before the apiserver served were dropped: the buffer was full; the log has them", "dropped", dropped)
			}
			<-hc.Context.Done()
			l.events.Attach(nil)
			b.Shutdown()
		}()
		return nil
	})
}

// namespacePollInterval is how often the events hook looks for the involved object's
// namespace before it starts posting.
const namespacePollInterval = 500 * time.Millisecond

// waitForNamespace returns once namespace exists ("" exists always), or with ctx's error.
// Other errors (the loopback client not served yet, a timeout) are retried too.
func waitForNamespace(ctx context.Context, client corev1client.NamespacesGetter, namespace string, every time.Duration) error {
	if namespace == "" {
		return nil
	}
	return wait.PollUntilContextCancel(ctx, every, true, func(ctx context.Context) (bool, error) {
		_, err := client.Namespaces().Get(ctx, namespace, metav1.GetOptions{})
		return err == nil, nil
	})
}

// eventCorrelation is client-go's spam filter sized for rekey. Every event is about one
// object (the identity Lease), and by default client-go lets 25 events of one type
// through per object, then one per 5 minutes: one rotation of a *.* configuration
// posts a migration started and a verified event per stored resource, so its key
// dropped event would be filtered out. The spam key here also holds the reason (each
// reason has its own budget) and the burst is larger; the refill stays client-go's.
func eventCorrelation() record.CorrelatorOptions {
	return record.CorrelatorOptions{
		BurstSize: eventBurst,
		SpamKeyFunc: func(e *corev1.Event) string {
			return strings.Join([]string{e.Source.Component, e.Source.Host, e.InvolvedObject.Kind, e.InvolvedObject.Namespace,
				e.InvolvedObject.Name, string(e.InvolvedObject.UID), e.InvolvedObject.APIVersion, e.Type, e.Reason}, "/")
		},
	}
}

// eventBurst is how many events of one reason pass at once: two per stored resource of
// a large *.* configuration.
const eventBurst = 256

// recorderSink posts events about one object through a client-go recorder.
type recorderSink struct {
	rec      record.EventRecorder
	involved *corev1.ObjectReference
}

func (s recorderSink) Event(kind events.Kind, reason, message string) {
	// The Events API takes at most 1 KiB of message; what is cut is in the log.
	s.rec.Event(s.involved, string(kind), reason, errtext.BoundedText(message, errtext.MaxPublished))
}

// reportRefusal sends a guard refusal's event; err is returned as it is.
func (l *Layer) reportRefusal(err error) error {
	if err != nil && errors.Is(err, guard.ErrRefused) {
		l.events.Event(events.Warning, events.ReasonGuardRefused, err.Error())
	}
	return err
}

// kmsKeyIDs reports a KMS provider's key id changing (kmsv2.FactoryOptions.OnKeyIDChange
// is called for a provider's first key id too, and again by every reload's new
// provider: those are not changes).
type kmsKeyIDs struct {
	sink events.Sink
	mu   sync.Mutex
	last map[string]string // provider name → key id hash
}

func (k *kmsKeyIDs) seen(provider, keyIDHash string) {
	k.mu.Lock()
	prev, known := k.last[provider]
	if k.last == nil {
		k.last = map[string]string{}
	}
	k.last[provider] = keyIDHash
	k.mu.Unlock()
	if known && prev != keyIDHash {
		k.sink.Event(events.Normal, events.ReasonKMSKeyIDChanged, fmt.Sprintf(
			"kms provider %s: the plugin's key id changed from %s to %s; new data is written under it once every apiserver's plugin reports it, and the migration rewrites the rest",
			provider, prev, keyIDHash))
	}
}
