package main

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	"github.com/spf13/cobra"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/client-go/dynamic"
	"k8s.io/client-go/dynamic/dynamicinformer"
	"k8s.io/client-go/kubernetes"
	typedcorev1 "k8s.io/client-go/kubernetes/typed/core/v1"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/cache"
	"k8s.io/client-go/tools/clientcmd"
	"k8s.io/client-go/tools/leaderelection"
	"k8s.io/client-go/tools/leaderelection/resourcelock"
	"k8s.io/client-go/tools/record"
	"k8s.io/client-go/util/retry"
	"k8s.io/client-go/util/workqueue"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/configsource"
	"github.com/rekey-io/rekey/internal/rotation"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// controllerOptions are rekey controller's flags.
type controllerOptions struct {
	kubeconfig, context string
	namespace           string
	leaderElect         bool
	leaseNamespace      string
	leaseName           string
	leaseDuration       time.Duration
	renewDeadline       time.Duration
	retryPeriod         time.Duration
	metricsAddr         string
	probeAddr           string
	resync              time.Duration
	retryFailed         time.Duration
	maxRotations        int
	interval            time.Duration
	etcdTimeout         time.Duration
}

func newControllerCommand() *cobra.Command {
	var o controllerOptions
	cmd := &cobra.Command{
		Use:   "controller",
		Short: "Rotate the encryption keys of many control planes as their ControlPlaneEncryption objects declare",
		Long: `controller reconciles rekey.io/v1alpha1 ControlPlaneEncryption objects (deploy/controller/crd.yaml):
one per managed control plane, naming the Secret its apiservers' EncryptionConfiguration is
projected from and how to reach its etcd. A raised spec.rotationGeneration, the annotation
rekey.io/operation=rotate, a due spec.rotationPeriod or an exceeded spec.rotateIfWritesOver
starts the rotation rekey rotate --wait --secret runs; its progress is the object's status
and Events. One rotation per object at a time; requests made meanwhile give one more
rotation after it. A controller stopped mid-rotation continues it when it starts again
(from the Secret, etcd and the status). docs/controller.md.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runController(cmd.Context(), o)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&o.kubeconfig, "kubeconfig", "", "The kubeconfig of the management API that holds the objects and Secrets (default: $KUBECONFIG, ~/.kube/config, or the pod's service account).")
	fs.StringVar(&o.context, "context", "", "The kubeconfig context (default: the current one).")
	fs.StringVar(&o.namespace, "namespace", "", "Watch ControlPlaneEncryption objects in this namespace only (default: every namespace).")
	fs.BoolVar(&o.leaderElect, "leader-elect", true, "Run only while holding the Lease --leader-election-namespace/--leader-election-id, so that one replica of the controller rotates at a time.")
	fs.StringVar(&o.leaseNamespace, "leader-election-namespace", "", "The Lease's namespace (default: the pod's namespace, else default).")
	fs.StringVar(&o.leaseName, "leader-election-id", "rekey-controller", "The Lease's name.")
	fs.DurationVar(&o.leaseDuration, "leader-election-lease-duration", 15*time.Second, "How long a non-leader waits before taking a Lease that is not renewed.")
	fs.DurationVar(&o.renewDeadline, "leader-election-renew-deadline", 10*time.Second, "How long the leader tries to renew before it stops.")
	fs.DurationVar(&o.retryPeriod, "leader-election-retry-period", 2*time.Second, "How often the Lease is tried.")
	fs.StringVar(&o.metricsAddr, "metrics-bind-address", ":8080", "Serve Prometheus metrics at /metrics on this address; 0 turns it off.")
	fs.StringVar(&o.probeAddr, "health-probe-bind-address", ":8081", "Serve /healthz and /readyz on this address; 0 turns it off.")
	fs.DurationVar(&o.resync, "resync-period", time.Minute, "How often every object is looked at again (rotationPeriod and rotateIfWritesOver are checked then).")
	fs.DurationVar(&o.retryFailed, "retry-failed-after", 5*time.Minute, "Resume a failed rotation after this long (at once on the annotation).")
	fs.IntVar(&o.maxRotations, "max-concurrent-rotations", 4, "Rotations of different objects run at the same time, at most.")
	fs.DurationVar(&o.etcdTimeout, "etcd-dial-timeout", 10*time.Second, "How long to wait for a control plane's etcd to answer.")
	fs.DurationVar(&o.interval, "wait-interval", 500*time.Millisecond, "How often a rotation reads the Secret and etcd.")
	_ = fs.MarkHidden("wait-interval")
	return cmd
}

func (o controllerOptions) restConfig() (*rest.Config, error) {
	rules := clientcmd.NewDefaultClientConfigLoadingRules()
	rules.ExplicitPath = o.kubeconfig
	rc, err := clientcmd.NewNonInteractiveDeferredLoadingClientConfig(rules, &clientcmd.ConfigOverrides{CurrentContext: o.context}).ClientConfig()
	if err != nil {
		return nil, fmt.Errorf("rekey controller: no management API: %w (give --kubeconfig, or run in a pod with a service account)", err)
	}
	rc.UserAgent = "rekey-controller"
	return rc, nil
}

// runController runs the controller until ctx ends or the leader lease is lost.
func runController(ctx context.Context, o controllerOptions) error {
	log := klog.FromContext(ctx).WithName("controller")
	rc, err := o.restConfig()
	if err != nil {
		return err
	}
	kube, err := kubernetes.NewForConfig(rc)
	if err != nil {
		return err
	}
	dyn, err := dynamic.NewForConfig(rc)
	if err != nil {
		return err
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	c, err := newController(o, kube, dyn, reg, log)
	if err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	serveErr := make(chan error, 2)
	if o.metricsAddr != "0" && o.metricsAddr != "" {
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		go func() { serveErr <- serveHTTP(ctx, "--metrics-bind-address", o.metricsAddr, mux) }()
	}
	if o.probeAddr != "0" && o.probeAddr != "" {
		mux := http.NewServeMux()
		mux.HandleFunc("/healthz", func(w http.ResponseWriter, _ *http.Request) { fmt.Fprintln(w, "ok") })
		mux.HandleFunc("/readyz", func(w http.ResponseWriter, _ *http.Request) {
			if !c.ready.Load() {
				http.Error(w, "the informer has not synced yet", http.StatusServiceUnavailable)
				return
			}
			fmt.Fprintln(w, "ok")
		})
		go func() { serveErr <- serveHTTP(ctx, "--health-probe-bind-address", o.probeAddr, mux) }()
	}
	go func() {
		if err := <-serveErr; err != nil {
			log.Error(err, "serving failed; stopping")
			cancel()
		}
	}()
	if !o.leaderElect {
		c.ready.Store(true)
		return c.run(ctx)
	}
	id, _ := os.Hostname()
	id += "_" + uuid.NewString()
	ns := o.leaseNamespace
	if ns == "" {
		ns = podNamespace()
	}
	lock := &resourcelock.LeaseLock{
		LeaseMeta:  metav1.ObjectMeta{Namespace: ns, Name: o.leaseName},
		Client:     kube.CoordinationV1(),
		LockConfig: resourcelock.ResourceLockConfig{Identity: id},
	}
	c.ready.Store(true) // a standby is ready: it serves its probes and waits for the lease
	var runErr error
	led := false
	leaderelection.RunOrDie(ctx, leaderelection.LeaderElectionConfig{
		Lock: lock, Name: "rekey-controller", ReleaseOnCancel: true,
		LeaseDuration: o.leaseDuration, RenewDeadline: o.renewDeadline, RetryPeriod: o.retryPeriod,
		Callbacks: leaderelection.LeaderCallbacks{
			OnStartedLeading: func(lctx context.Context) {
				led = true
				log.Info("holding the leader lease; reconciling", "lease", ns+"/"+o.leaseName, "identity", id)
				runErr = c.run(lctx)
			},
			OnStoppedLeading: func() { log.Info("not holding the leader lease", "lease", ns+"/"+o.leaseName, "identity", id) },
			OnNewLeader: func(who string) {
				if who != id {
					log.Info("another replica leads", "leader", who)
				}
			},
		},
	})
	switch {
	case runErr != nil:
		return runErr
	case ctx.Err() != nil:
		return nil
	case led:
		return fmt.Errorf("rekey controller: lost the leader lease %s/%s; exiting so that a restart waits for it again (running rotations continue under the next leader)", ns, o.leaseName)
	}
	return nil
}

func podNamespace() string {
	if b, err := os.ReadFile("/var/run/secrets/kubernetes.io/serviceaccount/namespace"); err == nil && len(b) > 0 {
		return string(b)
	}
	return "default"
}

func serveHTTP(ctx context.Context, flag, addr string, h http.Handler) error {
	l, err := net.Listen("tcp", addr)
	if err != nil {
		return fmt.Errorf("%s %s: %w", flag, addr, err)
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() {
		<-ctx.Done()
		_ = srv.Close()
	}()
	if err := srv.Serve(l); err != nil && !errors.Is(err, http.ErrServerClosed) {
		return err
	}
	return nil
}

// controllerMetrics are the controller's own metrics.
type controllerMetrics struct {
	rotations *prometheus.CounterVec
	running   prometheus.Gauge
	errors    prometheus.Counter
}

// controller reconciles ControlPlaneEncryption objects.
type controller struct {
	o        controllerOptions
	log      klog.Logger
	kube     kubernetes.Interface
	res      dynamic.NamespaceableResourceInterface
	factory  dynamicinformer.DynamicSharedInformerFactory
	informer cache.SharedIndexInformer
	queue    workqueue.TypedRateLimitingInterface[string]
	events   record.EventBroadcaster
	recorder record.EventRecorder
	metrics  controllerMetrics
	ready    atomic.Bool
	now      func() time.Time

	mu sync.Mutex
	// runs are the rotations running, by namespace/name.
	runs map[string]bool
	sem  chan struct{}
	wg   sync.WaitGroup
}

func newController(o controllerOptions, kube kubernetes.Interface, dyn dynamic.Interface, reg prometheus.Registerer, log klog.Logger) (*controller, error) {
	scheme := runtime.NewScheme()
	if err := v1alpha1.AddToScheme(scheme); err != nil {
		return nil, err
	}
	if o.maxRotations <= 0 {
		o.maxRotations = 1
	}
	if o.resync <= 0 {
		o.resync = time.Minute
	}
	c := &controller{
		o: o, log: log, kube: kube, res: dyn.Resource(v1alpha1.GroupVersionResource()), now: time.Now,
		runs: map[string]bool{}, sem: make(chan struct{}, o.maxRotations),
		queue: workqueue.NewTypedRateLimitingQueueWithConfig(workqueue.DefaultTypedControllerRateLimiter[string](),
			workqueue.TypedRateLimitingQueueConfig[string]{Name: "controlplaneencryptions"}),
	}
	c.factory = dynamicinformer.NewFilteredDynamicSharedInformerFactory(dyn, o.resync, o.namespace, nil)
	c.informer = c.factory.ForResource(v1alpha1.GroupVersionResource()).Informer()
	enqueue := func(obj any) {
		if key, err := cache.DeletionHandlingMetaNamespaceKeyFunc(obj); err == nil {
			c.queue.Add(key)
		}
	}
	if _, err := c.informer.AddEventHandler(cache.ResourceEventHandlerFuncs{
		AddFunc: enqueue, UpdateFunc: func(_, obj any) { enqueue(obj) }, DeleteFunc: enqueue,
	}); err != nil {
		return nil, err
	}
	c.events = record.NewBroadcaster()
	c.recorder = c.events.NewRecorder(scheme, corev1.EventSource{Component: "rekey-controller"})
	c.metrics = controllerMetrics{
		rotations: prometheus.NewCounterVec(prometheus.CounterOpts{Name: "rekey_controller_rotations_total",
			Help: "Rotations the controller ran to their end, by result (completed, failed)."}, []string{"result"}),
		running: prometheus.NewGauge(prometheus.GaugeOpts{Name: "rekey_controller_rotations_running", Help: "Rotations running now."}),
		errors: prometheus.NewCounter(prometheus.CounterOpts{Name: "rekey_controller_reconcile_errors_total",
			Help: "Reconciles that failed and were retried."}),
	}
	if reg != nil {
		for _, m := range []prometheus.Collector{c.metrics.rotations, c.metrics.running, c.metrics.errors} {
			if err := reg.Register(m); err != nil {
				return nil, err
			}
		}
	}
	return c, nil
}

// run reconciles until ctx ends, then waits for the rotations it started to stop
// (each stops where it is: the next leader resumes it).
func (c *controller) run(ctx context.Context) error {
	stopEvents := c.events.StartRecordingToSink(&typedcorev1.EventSinkImpl{Interface: c.kube.CoreV1().Events("")})
	defer stopEvents.Stop()
	defer c.wg.Wait()
	defer c.queue.ShutDown()
	c.factory.Start(ctx.Done())
	if !cache.WaitForCacheSync(ctx.Done(), c.informer.HasSynced) {
		if ctx.Err() != nil {
			return nil
		}
		return fmt.Errorf("rekey controller: the informer of %s did not sync: is deploy/controller/crd.yaml installed?", v1alpha1.GroupVersionResource())
	}
	c.log.Info("watching", "resource", v1alpha1.GroupVersionResource().String(), "namespace", c.o.namespace)
	go func() {
		<-ctx.Done()
		c.queue.ShutDown()
	}()
	for {
		key, quit := c.queue.Get()
		if quit {
			return nil
		}
		after, err := c.reconcile(ctx, key)
		switch {
		case err != nil && ctx.Err() == nil:
			c.metrics.errors.Inc()
			c.log.Error(err, "reconcile failed; retrying", "object", key)
			c.queue.AddRateLimited(key)
		case after > 0:
			c.queue.Forget(key)
			c.queue.AddAfter(key, after)
		default:
			c.queue.Forget(key)
		}
		c.queue.Done(key)
	}
}

// get is the object as the informer holds it.
func (c *controller) get(key string) (*v1alpha1.ControlPlaneEncryption, error) {
	obj, exists, err := c.informer.GetStore().GetByKey(key)
	if err != nil || !exists {
		return nil, err
	}
	return fromUnstructured(obj.(*unstructured.Unstructured))
}

func fromUnstructured(u *unstructured.Unstructured) (*v1alpha1.ControlPlaneEncryption, error) {
	var o v1alpha1.ControlPlaneEncryption
	if err := runtime.DefaultUnstructuredConverter.FromUnstructured(u.Object, &o); err != nil {
		return nil, fmt.Errorf("%s/%s does not decode as %s: %w", u.GetNamespace(), u.GetName(), v1alpha1.Kind, err)
	}
	return &o, nil
}

func toUnstructured(o *v1alpha1.ControlPlaneEncryption) (*unstructured.Unstructured, error) {
	m, err := runtime.DefaultUnstructuredConverter.ToUnstructured(o)
	if err != nil {
		return nil, err
	}
	u := &unstructured.Unstructured{Object: m}
	u.SetAPIVersion(v1alpha1.SchemeGroupVersion.String())
	u.SetKind(v1alpha1.Kind)
	return u, nil
}

// reconcile decides for one object (decideReconcile) and starts or resumes its
// rotation; it returns when to look again.
func (c *controller) reconcile(ctx context.Context, key string) (time.Duration, error) {
	o, err := c.get(key)
	if err != nil || o == nil {
		return 0, err
	}
	log := c.log.WithValues("object", key)
	c.mu.Lock()
	running := c.runs[key]
	c.mu.Unlock()
	annotated := o.Annotations[v1alpha1.OperationAnnotation] == v1alpha1.OperationRotate
	if running {
		if annotated {
			// A rotation runs: the annotation asks for one now, and this one is it.
			if err := c.takeAnnotation(ctx, o, foldAnnotation); err != nil {
				return 0, err
			}
			c.recorder.Event(o, corev1.EventTypeNormal, "AnnotationTaken", "rekey.io/operation=rotate is folded into the rotation that runs")
		}
		return 0, nil
	}
	d := decideReconcile(o, c.now(), c.o.retryFailed)
	if d.CheckWrites {
		due, why, err := c.writesDue(ctx, o)
		if err != nil {
			log.Error(err, "reading the write totals for rotateIfWritesOver failed")
		} else {
			log.V(2).Info("write budget", "decision", why)
			if due {
				d.Start, d.Triggers = true, []v1alpha1.Trigger{v1alpha1.TriggerWrites}
				c.recorder.Event(o, corev1.EventTypeNormal, "WriteBudgetExceeded", why)
			}
		}
	}
	if d.Start || d.Resume {
		// The informer may lag behind this controller's own writes (a rotation that
		// just ended): decide again from the object as the API has it now.
		u, err := c.res.Namespace(o.Namespace).Get(ctx, o.Name, metav1.GetOptions{})
		if apierrors.IsNotFound(err) {
			return 0, nil
		}
		if err != nil {
			return 0, err
		}
		if o, err = fromUnstructured(u); err != nil {
			return 0, err
		}
		writes := d.Triggers
		d = decideReconcile(o, c.now(), c.o.retryFailed)
		if !d.Start && !d.Resume && slices.Contains(writes, v1alpha1.TriggerWrites) && o.Status.Rotation == nil {
			d.Start, d.Triggers = true, writes
		}
	}
	if !d.Start && !d.Resume {
		if d.TakeAnnotation {
			return 0, c.takeAnnotation(ctx, o, func(*v1alpha1.ControlPlaneEncryptionStatus) {})
		}
		return d.After, nil
	}
	now := metav1.NewTime(c.now())
	if d.Start {
		// Recorded first, with the object's resourceVersion: a trigger is taken once
		// (a second reconcile of the same version conflicts).
		next := o.DeepCopy()
		startRotation(next, d, now)
		u, err := toUnstructured(next)
		if err != nil {
			return 0, err
		}
		got, err := c.res.Namespace(o.Namespace).UpdateStatus(ctx, u, metav1.UpdateOptions{FieldManager: "rekey-controller"})
		if apierrors.IsConflict(err) {
			return 0, fmt.Errorf("%s changed while the rotation was being recorded; deciding again", key)
		}
		if err != nil {
			return 0, fmt.Errorf("recording the rotation of %s in its status: %w", key, err)
		}
		if o, err = fromUnstructured(got); err != nil {
			return 0, err
		}
		log.Info("rotation started", "generation", o.Status.ObservedRotationGeneration, "triggers", triggerText(d.Triggers))
		c.recorder.Eventf(o, corev1.EventTypeNormal, "RotationStarted", "rotation of generation %d started (%s)", o.Status.ObservedRotationGeneration, triggerText(d.Triggers))
	} else {
		log.Info("resuming the rotation recorded in the status", "generation", o.Status.Rotation.Generation, "firstEditWritten", d.ResumeOnly)
		c.recorder.Eventf(o, corev1.EventTypeNormal, "RotationResumed", "resuming the rotation of generation %d where it stopped", o.Status.Rotation.Generation)
	}
	if d.TakeAnnotation {
		if err := c.takeAnnotation(ctx, o, foldAnnotation); err != nil {
			log.Error(err, "removing the annotation failed; it is removed at the next reconcile")
		}
	}
	c.start(ctx, key, o, d.ResumeOnly)
	return 0, nil
}

// takeAnnotation records the annotation in the status (record), then removes it.
func (c *controller) takeAnnotation(ctx context.Context, o *v1alpha1.ControlPlaneEncryption, record func(*v1alpha1.ControlPlaneEncryptionStatus)) error {
	if err := c.updateStatus(ctx, o.Namespace, o.Name, func(x *v1alpha1.ControlPlaneEncryption) { record(&x.Status) }); err != nil {
		return err
	}
	patch := fmt.Appendf(nil, `{"metadata":{"annotations":{%q:null}}}`, v1alpha1.OperationAnnotation)
	_, err := c.res.Namespace(o.Namespace).Patch(ctx, o.Name, types.MergePatchType, patch, metav1.PatchOptions{FieldManager: "rekey-controller"})
	if err != nil && !apierrors.IsNotFound(err) {
		return fmt.Errorf("removing %s from %s/%s: %w", v1alpha1.OperationAnnotation, o.Namespace, o.Name, err)
	}
	return nil
}

// updateStatus applies mutate to the object as the API has it now and writes its
// status, again on a conflict.
func (c *controller) updateStatus(ctx context.Context, ns, name string, mutate func(*v1alpha1.ControlPlaneEncryption)) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		u, err := c.res.Namespace(ns).Get(ctx, name, metav1.GetOptions{})
		if err != nil {
			return err
		}
		o, err := fromUnstructured(u)
		if err != nil {
			return err
		}
		mutate(o)
		if u, err = toUnstructured(o); err != nil {
			return err
		}
		_, err = c.res.Namespace(ns).UpdateStatus(ctx, u, metav1.UpdateOptions{FieldManager: "rekey-controller"})
		return err
	})
}

// start runs the object's rotation in its own goroutine (at most
// --max-concurrent-rotations at once); the object is reconciled again when it ends.
func (c *controller) start(ctx context.Context, key string, o *v1alpha1.ControlPlaneEncryption, resumeOnly bool) {
	c.mu.Lock()
	c.runs[key] = true
	c.mu.Unlock()
	c.wg.Add(1)
	go func() {
		defer c.wg.Done()
		defer func() {
			c.mu.Lock()
			delete(c.runs, key)
			c.mu.Unlock()
			c.queue.Add(key)
		}()
		select {
		case c.sem <- struct{}{}:
		case <-ctx.Done():
			return
		}
		defer func() { <-c.sem }()
		c.metrics.running.Inc()
		defer c.metrics.running.Dec()
		c.rotate(ctx, o, resumeOnly)
	}()
}

// rotate runs driveRotation for o with its Secret as the source and writes the
// outcome. A rotation stopped by ctx (shutdown, a lost lease) writes nothing: it is
// resumed from the status.
func (c *controller) rotate(ctx context.Context, o *v1alpha1.ControlPlaneEncryption, resumeOnly bool) {
	key := o.Namespace + "/" + o.Name
	log := c.log.WithValues("object", key)
	obs := &statusObserver{c: c, o: o, log: log}
	cm, d, cleanup, err := c.setUp(ctx, o)
	if err == nil {
		defer cleanup()
		d.resumeOnly = resumeOnly
		err = cm.driveRotation(ctx, d, obs)
	}
	if ctx.Err() != nil {
		log.Info("stopped; the rotation continues when a controller resumes it", "reason", ctx.Err())
		return
	}
	werr := c.updateStatus(context.WithoutCancel(ctx), o.Namespace, o.Name, func(x *v1alpha1.ControlPlaneEncryption) {
		finishRotation(x, obs.last, err, metav1.NewTime(c.now()))
	})
	if werr != nil {
		log.Error(werr, "writing the rotation's end to the status failed; the next reconcile resumes it")
	}
	if err != nil {
		c.metrics.rotations.WithLabelValues("failed").Inc()
		log.Error(err, "rotation failed", "retryAfter", c.o.retryFailed)
		c.recorder.Eventf(o, corev1.EventTypeWarning, "RotationFailed", "%s (resumed after %s, or at once with the annotation %s=%s)",
			truncate(controllerWords(oneLine(err.Error())), 800), c.o.retryFailed, v1alpha1.OperationAnnotation, v1alpha1.OperationRotate)
		return
	}
	c.metrics.rotations.WithLabelValues("completed").Inc()
	log.Info("rotation complete")
	c.recorder.Event(o, corev1.EventTypeNormal, "RotationCompleted", "every apiserver runs the configuration with the new key and no old key; every stored object is under it")
}

func truncate(s string, n int) string {
	if len(s) > n {
		return s[:n] + "…"
	}
	return s
}

// setUp is what driveRotation needs for o: a common reaching its etcd (client TLS
// from its Secret, written to a private directory cleanup removes) with its Secret
// as the source, and the drive from its spec.
func (c *controller) setUp(ctx context.Context, o *v1alpha1.ControlPlaneEncryption) (*common, drive, func(), error) {
	sp := o.Spec
	cm := &common{etcdPrefix: sp.Etcd.EtcdPrefix, timeout: c.o.etcdTimeout, pageSize: migrate.DefaultPageSize, kmsWait: 15 * time.Second, resources: sp.Resources}
	if cm.etcdPrefix == "" {
		cm.etcdPrefix = migrate.DefaultEtcdPrefix
	}
	if cm.timeout <= 0 {
		cm.timeout = 10 * time.Second
	}
	cm.etcd.Servers = sp.Etcd.Endpoints
	cm.src.set = configsource.Secret{Client: c.kube.CoreV1(), Ref: configsource.SecretRef{Namespace: o.Namespace, Name: sp.ConfigSecretRef.Name, Key: sp.ConfigSecretRef.Key}}
	prefix := cm.coordinationPrefix(sp.Etcd.CoordinationPrefix)
	if err := coordination.ValidatePrefix(prefix, cm.etcdPrefix); err != nil {
		return nil, drive{}, nil, fmt.Errorf("spec.etcd: %w", err)
	}
	cm.retention.prefix = &prefix
	d := drive{prefix: prefix, interval: c.o.interval, removeIdentity: sp.RemoveIdentityFallback, timeout: 30 * time.Minute}
	if sp.Timeout != nil && sp.Timeout.Duration > 0 {
		d.timeout = sp.Timeout.Duration
	}
	d.request = rotation.Request{Resources: sp.Resources, Random: rand.Reader}
	if p := sp.Provider; p != nil {
		d.request.Provider = p.Type
		if p.KMS != nil {
			d.request.KMSName, d.request.KMSEndpoint = p.KMS.Name, p.KMS.Endpoint
			if p.KMS.Timeout != nil {
				d.request.KMSTimeout = p.KMS.Timeout.Duration
			}
		}
	}
	d.stderr = logWriter{log: c.log.WithValues("object", o.Namespace+"/"+o.Name)}
	cleanup := func() {}
	if ref := sp.Etcd.TLSSecretRef; ref != nil {
		sec, err := c.kube.CoreV1().Secrets(o.Namespace).Get(ctx, ref.Name, metav1.GetOptions{})
		if err != nil {
			return nil, drive{}, nil, fmt.Errorf("spec.etcd.tlsSecretRef: reading secret %s/%s: %w", o.Namespace, ref.Name, err)
		}
		dir, err := os.MkdirTemp("", "rekey-etcd-tls-")
		if err != nil {
			return nil, drive{}, nil, err
		}
		cleanup = func() { _ = os.RemoveAll(dir) }
		for _, f := range []struct {
			key  string
			path *string
		}{{"ca.crt", &cm.etcd.CAFile}, {"tls.crt", &cm.etcd.CertFile}, {"tls.key", &cm.etcd.KeyFile}} {
			b, ok := sec.Data[f.key]
			if !ok {
				cleanup()
				return nil, drive{}, nil, fmt.Errorf("spec.etcd.tlsSecretRef: secret %s/%s has no %s (it needs ca.crt, tls.crt and tls.key)", o.Namespace, ref.Name, f.key)
			}
			*f.path = filepath.Join(dir, f.key)
			if err := os.WriteFile(*f.path, b, 0o600); err != nil {
				cleanup()
				return nil, drive{}, nil, err
			}
		}
	}
	return cm, d, cleanup, nil
}

// writesDue reads the apiservers' write totals for spec.rotateIfWritesOver (the
// decision of rekey rotate --if-writes-over).
func (c *controller) writesDue(ctx context.Context, o *v1alpha1.ControlPlaneEncryption) (bool, string, error) {
	cm, d, cleanup, err := c.setUp(ctx, o)
	if err != nil {
		return false, "", err
	}
	defer cleanup()
	f, err := cm.readSource(ctx, "the configuration is not valid, so the write budget is not checked")
	if err != nil {
		return false, "", err
	}
	return cm.rotationDue(ctx, f.File, rotateCondition{writesOver: uint64(o.Spec.RotateIfWritesOver)}, d.prefix)
}

// logWriter logs what a rotation would print on stderr (the first edit's warnings).
type logWriter struct{ log klog.Logger }

func (w logWriter) Write(p []byte) (int, error) {
	w.log.Info("warning", "text", oneLine(string(p)))
	return len(p), nil
}

// statusObserver shows a running rotation in its object's status and Events.
type statusObserver struct {
	c   *controller
	o   *v1alpha1.ControlPlaneEncryption
	log klog.Logger
	// last is the last round; shown is what the status shows of it; at is when it
	// was written.
	last           rotationRound
	shown, waiting string
	at             time.Time
}

func (s *statusObserver) Line(l string) {
	l = controllerWords(l)
	s.log.Info(l)
	s.c.recorder.Event(s.o, corev1.EventTypeNormal, "Rotation", truncate(l, 1000))
}

func (s *statusObserver) Note(l string) { s.log.Info(l) }

// statusWriteEvery bounds how often a round is written to the status when only what
// it waits for changed.
const statusWriteEvery = 2 * time.Second

func (s *statusObserver) Round(r rotationRound) error {
	s.last = r
	if r.Ready.Action == rotation.ActionDone || r.Ready.Action == rotation.ActionFail {
		return nil // the end is written by rotate
	}
	stage := r.Ready.Stage.String()
	var strag []string
	if r.File != nil {
		for _, x := range stragglers(r.Members, r.File.Config.Hash) {
			strag = append(strag, x.APIServerID)
		}
	}
	shown := fmt.Sprint(stage, "|", phaseOf(r.Ready), "|", strag)
	waiting := fmt.Sprint(shown, "|", r.Ready.Waiting)
	now := s.c.now()
	if shown == s.shown && (waiting == s.shownWaiting() || now.Sub(s.at) < statusWriteEvery) {
		return nil
	}
	err := s.c.updateStatus(context.Background(), s.o.Namespace, s.o.Name, func(x *v1alpha1.ControlPlaneEncryption) {
		applyRound(x, r, metav1.NewTime(now))
	})
	if apierrors.IsNotFound(err) {
		return fmt.Errorf("%s/%s was deleted; the rotation stops where it is (what was written stays, and rekey rotate --wait --secret continues it)", s.o.Namespace, s.o.Name)
	}
	if err != nil {
		s.log.Error(err, "writing the status failed; trying again next round")
		return nil
	}
	s.shown, s.at, s.waiting = shown, now, waiting
	return nil
}

func (s *statusObserver) shownWaiting() string { return s.waiting }

// Edited records the first edit in the status before the rotation goes on: from then
// on a restarted controller resumes it without adding a key.
func (s *statusObserver) Edited(first bool, e *rotation.Edit) error {
	if !first {
		s.c.recorder.Eventf(s.o, corev1.EventTypeNormal, "OldKeyRemoved", "second edit written: %s", truncate(e.Summary, 900))
		return nil
	}
	err := s.c.updateStatus(context.Background(), s.o.Namespace, s.o.Name, func(x *v1alpha1.ControlPlaneEncryption) {
		firstEditRecorded(x, e, s.last.Members)
	})
	if err != nil {
		return fmt.Errorf("the new key is in the Secret, but recording it in the status failed (%w); the rotation resumes from the Secret at the next reconcile", err)
	}
	s.c.recorder.Eventf(s.o, corev1.EventTypeNormal, "NewKeyWritten", "first edit written: %s", truncate(e.Summary, 900))
	return nil
}
