package testbed

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// Endpoint is one apiserver as the workload sees it: a client, and whether a load
// balancer would send it traffic now. Failures on an endpoint out of rotation (a
// shim the scenario killed, or one not ready) are excused.
type Endpoint interface {
	Name() string
	Client() (kubernetes.Interface, error)
	InRotation() bool
}

// ShimEndpoint is a single shim as an Endpoint, always in rotation while its
// process runs.
type ShimEndpoint struct {
	Shim *Shim
	once sync.Once
	c    *kubernetes.Clientset
	err  error
}

// Name implements Endpoint.
func (e *ShimEndpoint) Name() string { return e.Shim.Name }

// Client implements Endpoint.
func (e *ShimEndpoint) Client() (kubernetes.Interface, error) {
	e.once.Do(func() { e.c, e.err = kubernetes.NewForConfig(e.Shim.RESTConfig()) })
	return e.c, e.err
}

// InRotation implements Endpoint.
func (e *ShimEndpoint) InRotation() bool {
	select {
	case <-e.Shim.Done():
		return false
	default:
		return true
	}
}

// valueKey is the Secret data key the workload writes.
const valueKey = "v"

// Workload is the record of Secrets written through a set of endpoints: for each
// object, the value and resourceVersion of its last acknowledged write, and the
// values of writes whose outcome is unknown (the request failed, but etcd may have
// applied it). Each object has one owner goroutine, so "last acknowledged" is
// well defined. Values are "<name>#<seq>" with seq rising per object, which lets a
// reader tell an older value from a newer one.
type Workload struct {
	Namespace string
	endpoints []Endpoint

	mu      sync.Mutex
	objects map[string]*objectRecord
	names   []string // acknowledged objects, in creation order
}

type objectRecord struct {
	ackSeq int64 // 0: never acknowledged
	ackRV  string
	// unknown are sequence numbers written after ackSeq whose outcome is unknown.
	unknown []int64
}

// NewWorkload returns an empty record for Secrets in namespace, written and read
// through endpoints.
func NewWorkload(namespace string, endpoints []Endpoint) *Workload {
	return &Workload{Namespace: namespace, endpoints: endpoints, objects: map[string]*objectRecord{}}
}

// Endpoints are the workload's endpoints.
func (w *Workload) Endpoints() []Endpoint { return w.endpoints }

func seqValue(name string, seq int64) string { return name + "#" + strconv.FormatInt(seq, 10) }

// parseSeq returns the sequence number of a value of object name.
func parseSeq(name, v string) (int64, bool) {
	rest, ok := strings.CutPrefix(v, name+"#")
	if !ok {
		return 0, false
	}
	n, err := strconv.ParseInt(rest, 10, 64)
	return n, err == nil
}

func (w *Workload) ack(name string, seq int64, rv string) {
	w.mu.Lock()
	defer w.mu.Unlock()
	r := w.objects[name]
	if r == nil {
		r = &objectRecord{}
		w.objects[name] = r
	}
	if r.ackSeq == 0 {
		w.names = append(w.names, name)
	}
	r.ackSeq, r.ackRV = seq, rv
	r.unknown = slices.DeleteFunc(r.unknown, func(s int64) bool { return s <= seq })
}

func (w *Workload) maybe(name string, seq int64) {
	w.mu.Lock()
	defer w.mu.Unlock()
	r := w.objects[name]
	if r == nil {
		r = &objectRecord{}
		w.objects[name] = r
	}
	r.unknown = append(r.unknown, seq)
}

// acked returns the acknowledged sequence number of name (0 if none).
func (w *Workload) acked(name string) int64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	if r := w.objects[name]; r != nil {
		return r.ackSeq
	}
	return 0
}

// Names are the acknowledged objects.
func (w *Workload) Names() []string {
	w.mu.Lock()
	defer w.mu.Unlock()
	return slices.Clone(w.names)
}

// Objects is the number of acknowledged objects.
func (w *Workload) Objects() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	return len(w.names)
}

// UnknownCreates is the number of objects whose create had an unknown outcome (the
// request failed or was cut off by Stop, but etcd may have applied it) and that were
// never acknowledged: each may or may not exist.
func (w *Workload) UnknownCreates() int {
	w.mu.Lock()
	defer w.mu.Unlock()
	n := 0
	for _, r := range w.objects {
		if r.ackSeq == 0 && len(r.unknown) > 0 {
			n++
		}
	}
	return n
}

// Seed creates n Secrets (<prefix>-<i>) spread over the endpoints in rotation,
// with parallel requests; any failure ends it.
func (w *Workload) Seed(ctx context.Context, prefix string, n, parallel int) error {
	var next atomic.Int64
	errs := make([]error, parallel)
	var wg sync.WaitGroup
	for g := range parallel {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= n {
					return
				}
				ep := w.endpoints[i%len(w.endpoints)]
				c, err := ep.Client()
				if err == nil {
					err = w.create(ctx, c, fmt.Sprintf("%s-%d", prefix, i))
				}
				if err != nil {
					errs[g] = fmt.Errorf("seeding through %s: %w", ep.Name(), err)
					return
				}
			}
		})
	}
	wg.Wait()
	return errors.Join(errs...)
}

func (w *Workload) create(ctx context.Context, c kubernetes.Interface, name string) error {
	ctx, cancel := context.WithTimeout(ctx, requestTimeout)
	defer cancel()
	s, err := c.CoreV1().Secrets(w.Namespace).Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
		Data: map[string][]byte{valueKey: []byte(seqValue(name, 1))}}, metav1.CreateOptions{})
	if err != nil {
		w.maybe(name, 1)
		return err
	}
	w.ack(name, 1, s.ResourceVersion)
	return nil
}

// requestTimeout bounds every request of writers and sampler, so a hung shim shows
// as errors instead of a stuck test.
const requestTimeout = 10 * time.Second

// WritersConfig configures Writers.
type WritersConfig struct {
	// PerEndpoint is the number of writer goroutines per endpoint (default 2).
	PerEndpoint int
	// Pause is each goroutine's pause between writes, bounding the write rate and
	// the CPU used (default 20 ms).
	Pause time.Duration
	// CreateEvery makes every k-th write of a goroutine a create (0: updates only).
	CreateEvery int
	// ExcuseNotReady excuses a failed write on an endpoint that says it is not ready
	// when asked right after the failure, as SamplerConfig.ExcuseNotReady does.
	ExcuseNotReady bool
	// ExcuseEtcdLeaderLoss excuses a write that etcd itself failed while it elected a
	// new leader, or that was in flight to a member killed under it (a scenario that
	// kills etcd members): any apiserver answers those with an error, and clients
	// retry them.
	ExcuseEtcdLeaderLoss bool
	// Latency, when set, is told how long every request the writers sent took to be
	// answered, with its verb (create, update, get: the read after a conflict), from
	// their goroutines; requests cut short by Stop are not told.
	Latency LatencyFunc
}

// LatencyFunc is told one answered request's verb and latency (a request answered
// with an error counts: the client waited for that answer too).
type LatencyFunc func(verb string, latency time.Duration)

// timed calls f and tells observe (when set) how long it took, unless ctx was
// cancelled meanwhile (the run stopping, not the server answering).
func timed(ctx context.Context, observe LatencyFunc, verb string, f func() error) error {
	if observe == nil {
		return f()
	}
	start := time.Now()
	err := f()
	if ctx.Err() == nil {
		observe(verb, time.Since(start))
	}
	return err
}

// etcdLeaderLoss reports etcd's own errors of a leader election in progress, or of a
// request lost with the member it was sent to, as an apiserver passes them on.
func etcdLeaderLoss(err error) bool {
	for _, s := range []string{"etcdserver: leader changed", "etcdserver: no leader", "etcdserver: request timed out",
		// A request in flight on the apiserver's connection to the member that went down.
		"code = Unavailable desc = error reading from server"} {
		if strings.Contains(err.Error(), s) {
			return true
		}
	}
	return false
}

// Writers update the workload's Secrets through every endpoint. Every object is
// owned by one goroutine, which reads it back after a conflict (a migration's
// rewrite changes its resourceVersion) and retries.
type Writers struct {
	w      *Workload
	cfg    WritersConfig
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu        sync.Mutex
	perEP     map[string]*WriteCounts
	errs      []string
	conflicts atomic.Int64
}

// WriteCounts are one endpoint's write outcomes.
type WriteCounts struct {
	// Acked writes were acknowledged.
	Acked int64
	// Failed writes failed while the endpoint was in rotation.
	Failed int64
	// Excused writes failed while it was out of rotation (killed, not ready).
	Excused int64
	// LeaderLoss are the Failed writes that failed with etcd's own errors of a leader
	// election (etcdLeaderLoss): a scenario that proves etcd elected a leader meanwhile
	// may excuse them (WriteReport.LeaderLoss).
	LeaderLoss int64
}

// StartWriters starts writers on the objects the workload holds now; each
// endpoint's goroutines own a share of them.
func (w *Workload) StartWriters(ctx context.Context, cfg WritersConfig) *Writers {
	if cfg.PerEndpoint <= 0 {
		cfg.PerEndpoint = 2
	}
	if cfg.Pause == 0 {
		cfg.Pause = 20 * time.Millisecond
	}
	ctx, cancel := context.WithCancel(ctx)
	wr := &Writers{w: w, cfg: cfg, cancel: cancel, perEP: map[string]*WriteCounts{}}
	names := w.Names()
	total := len(w.endpoints) * cfg.PerEndpoint
	for e, ep := range w.endpoints {
		wr.perEP[ep.Name()] = &WriteCounts{}
		for g := range cfg.PerEndpoint {
			id := e*cfg.PerEndpoint + g
			var owned []string
			for i := id; i < len(names); i += total {
				owned = append(owned, names[i])
			}
			wr.wg.Go(func() { wr.run(ctx, ep, id, owned) })
		}
	}
	return wr
}

func (wr *Writers) run(ctx context.Context, ep Endpoint, id int, owned []string) {
	rvs := map[string]string{}
	for iter := 0; ; iter++ {
		select {
		case <-ctx.Done():
			return
		case <-time.After(wr.cfg.Pause):
		}
		if !ep.InRotation() {
			continue // a load balancer sends it nothing
		}
		c, err := ep.Client()
		if err != nil {
			wr.count(ep, err)
			continue
		}
		if wr.cfg.CreateEvery > 0 && iter%wr.cfg.CreateEvery == wr.cfg.CreateEvery-1 || len(owned) == 0 {
			name := fmt.Sprintf("%s-new-%d-%d", ep.Name(), id, iter)
			err := timed(ctx, wr.cfg.Latency, "create", func() error { return wr.w.create(ctx, c, name) })
			if ctx.Err() != nil {
				return
			}
			wr.count(ep, err)
			if err == nil {
				owned = append(owned, name)
			}
			continue
		}
		name := owned[iter%len(owned)]
		err = wr.update(ctx, c, name, rvs)
		if ctx.Err() != nil {
			return
		}
		wr.count(ep, err)
	}
}

// update writes the next value of name, starting from the resourceVersion of its
// last acknowledged write.
func (wr *Writers) update(ctx context.Context, c kubernetes.Interface, name string, rvs map[string]string) error {
	w := wr.w
	w.mu.Lock()
	r := w.objects[name]
	seq := r.ackSeq + int64(len(r.unknown)) + 1
	rv := r.ackRV
	w.mu.Unlock()
	if v, ok := rvs[name]; ok {
		rv = v
	}
	secrets := c.CoreV1().Secrets(w.Namespace)
	for attempt := 0; attempt < 10; attempt++ {
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		var s *corev1.Secret
		err := timed(ctx, wr.cfg.Latency, "update", func() (err error) {
			s, err = secrets.Update(rctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name, ResourceVersion: rv},
				Data: map[string][]byte{valueKey: []byte(seqValue(name, seq))}}, metav1.UpdateOptions{})
			return err
		})
		cancel()
		if err == nil {
			w.ack(name, seq, s.ResourceVersion)
			delete(rvs, name)
			return nil
		}
		if !apierrors.IsConflict(err) {
			w.maybe(name, seq)
			return err
		}
		wr.conflicts.Add(1)
		// Someone else changed it: a migration's rewrite (same value) or our own
		// write whose answer was lost. Read the current version and go on from it.
		rctx, cancel = context.WithTimeout(ctx, requestTimeout)
		var cur *corev1.Secret
		err = timed(ctx, wr.cfg.Latency, "get", func() (err error) {
			cur, err = secrets.Get(rctx, name, metav1.GetOptions{})
			return err
		})
		cancel()
		if err != nil {
			return fmt.Errorf("reading %s after a conflict: %w", name, err)
		}
		if got, ok := parseSeq(name, string(cur.Data[valueKey])); ok && got > w.acked(name) {
			// An earlier attempt of ours whose answer was lost was applied after all.
			w.ack(name, got, cur.ResourceVersion)
			seq = max(seq, got+1)
		}
		rv = cur.ResourceVersion
		rvs[name] = rv
	}
	return fmt.Errorf("updating %s: 10 conflicts in a row", name)
}

func (wr *Writers) count(ep Endpoint, err error) {
	// Asked before the lock: a readiness request must not stall the other writers.
	excused := err != nil && (!ep.InRotation() || wr.cfg.ExcuseEtcdLeaderLoss && etcdLeaderLoss(err) ||
		wr.cfg.ExcuseNotReady && notReadyNow(context.Background(), ep))
	wr.mu.Lock()
	defer wr.mu.Unlock()
	c := wr.perEP[ep.Name()]
	switch {
	case err == nil:
		c.Acked++
	case excused:
		c.Excused++
	default:
		c.Failed++
		if etcdLeaderLoss(err) {
			c.LeaderLoss++
		}
		if len(wr.errs) < 20 {
			wr.errs = append(wr.errs, ep.Name()+": "+err.Error())
		}
	}
}

// WriteReport is what Writers did.
type WriteReport struct {
	PerEndpoint map[string]WriteCounts
	// Conflicts were retried (a migration's rewrite, typically).
	Conflicts int64
	// Errors are the first failed writes' errors.
	Errors []string
}

// Acked is the number of acknowledged writes over all endpoints.
func (r WriteReport) Acked() (n int64) {
	for _, c := range r.PerEndpoint {
		n += c.Acked
	}
	return n
}

// Failed is the number of failed writes on endpoints in rotation.
func (r WriteReport) Failed() (n int64) {
	for _, c := range r.PerEndpoint {
		n += c.Failed
	}
	return n
}

// LeaderLoss is the number of failed writes that failed with etcd's errors of a leader
// election.
func (r WriteReport) LeaderLoss() (n int64) {
	for _, c := range r.PerEndpoint {
		n += c.LeaderLoss
	}
	return n
}

func (r WriteReport) String() string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(r.PerEndpoint)) {
		c := r.PerEndpoint[name]
		part := fmt.Sprintf("%s: %d acked, %d failed, %d excused", name, c.Acked, c.Failed, c.Excused)
		if c.LeaderLoss > 0 {
			part += fmt.Sprintf(" (%d of the failed in an etcd leader election)", c.LeaderLoss)
		}
		parts = append(parts, part)
	}
	return fmt.Sprintf("%s; %d conflicts retried", strings.Join(parts, "; "), r.Conflicts)
}

// Report returns the counts so far.
func (wr *Writers) Report() WriteReport {
	wr.mu.Lock()
	defer wr.mu.Unlock()
	r := WriteReport{PerEndpoint: map[string]WriteCounts{}, Conflicts: wr.conflicts.Load(), Errors: slices.Clone(wr.errs)}
	for name, c := range wr.perEP {
		r.PerEndpoint[name] = *c
	}
	return r
}

// Stop stops the writers, waits for them and reports.
func (wr *Writers) Stop() WriteReport {
	wr.cancel()
	wr.wg.Wait()
	return wr.Report()
}
