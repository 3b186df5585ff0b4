package testbed

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
)

// SamplerConfig configures a Sampler.
type SamplerConfig struct {
	// Rate is the number of reads per second over all endpoints (default 100).
	Rate float64
	// Readers is the number of concurrent reads (default 2), so one slow read does
	// not stall the sampling.
	Readers int
	// ExcuseNotReady excuses a failed read on an endpoint that says it is not ready
	// when asked right after the failure (a FleetShim asks its /readyz): a load
	// balancer would not send it traffic, and the invariant is about ready members.
	ExcuseNotReady bool
	// Latency, when set, is told how long every read took to be answered (verb get),
	// as WritersConfig.Latency is.
	Latency LatencyFunc
}

// Sampler reads every acknowledged object through every endpoint in turn (each
// object through each endpoint, then the next object), at a bounded rate, for the
// whole run, and classifies what it reads.
type Sampler struct {
	w      *Workload
	cfg    SamplerConfig
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu       sync.Mutex
	perEP    map[string]*SampleCounts
	examples []string
}

// SampleCounts are one endpoint's read outcomes. Only reads on an endpoint in
// rotation count against it; failures while it is out are Excused.
type SampleCounts struct {
	Reads int64
	// Unreadable reads failed with a server error (5xx: a value it cannot decrypt or
	// decode).
	Unreadable int64
	// Missing reads found an acknowledged object absent (404).
	Missing int64
	// Stale reads returned a value older than the object's last acknowledged write
	// at the moment the read started: a lost or overwritten write.
	Stale int64
	// Errors are other failures in rotation (timeouts, connection errors, 4xx).
	Errors int64
	// LeaderLoss reads failed in rotation with etcd's own errors of a leader election
	// (an apiserver answers them with a 500, but they say nothing of what it stored): a
	// scenario that proves etcd elected a leader meanwhile may excuse them.
	LeaderLoss int64
	// Excused failures happened while the endpoint was out of rotation.
	Excused int64
}

// StartSampler starts sampling until Stop.
func (w *Workload) StartSampler(ctx context.Context, cfg SamplerConfig) *Sampler {
	if cfg.Rate <= 0 {
		cfg.Rate = 100
	}
	if cfg.Readers <= 0 {
		cfg.Readers = 2
	}
	ctx, cancel := context.WithCancel(ctx)
	s := &Sampler{w: w, cfg: cfg, cancel: cancel, perEP: map[string]*SampleCounts{}}
	for _, ep := range w.endpoints {
		s.perEP[ep.Name()] = &SampleCounts{}
	}
	work := make(chan int)
	s.wg.Go(func() {
		defer close(work)
		tick := time.NewTicker(time.Duration(float64(time.Second) / cfg.Rate))
		defer tick.Stop()
		for k := 0; ; {
			select {
			case <-ctx.Done():
				return
			case <-tick.C:
			}
			select {
			case work <- k: // readers busy: the tick is skipped, the rate stays bounded
				k++
			default:
			}
		}
	})
	for range cfg.Readers {
		s.wg.Go(func() {
			var names []string
			for k := range work {
				nEP := len(w.endpoints)
				if k%(nEP*max(len(names), 1)) == 0 || len(names) == 0 {
					names = w.Names() // a new round picks up objects created since
				}
				if len(names) == 0 {
					continue
				}
				s.read(ctx, w.endpoints[k%nEP], names[(k/nEP)%len(names)])
			}
		})
	}
	return s
}

func (s *Sampler) read(ctx context.Context, ep Endpoint, name string) {
	before := s.w.acked(name)
	// Whether a load balancer would have sent the read, asked before it is sent: a
	// straggler whose file catches up fails a read sent while it was out of rotation
	// and may be ready again by the time the failure is judged.
	sentOut := !ep.InRotation()
	c, err := ep.Client()
	var v string
	if err == nil {
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		var sec *corev1.Secret
		err = timed(ctx, s.cfg.Latency, "get", func() (gerr error) {
			sec, gerr = c.CoreV1().Secrets(s.w.Namespace).Get(rctx, name, metav1.GetOptions{})
			return gerr
		})
		cancel()
		if err == nil {
			v = string(sec.Data[valueKey])
		}
	}
	if ctx.Err() != nil {
		return // stopping: the read was cut short by the test, not by the server
	}
	// Asked before the lock: a readiness request must not stall the other readers.
	excused := err != nil && (sentOut || !ep.InRotation() || s.cfg.ExcuseNotReady && notReadyNow(ctx, ep))
	s.mu.Lock()
	defer s.mu.Unlock()
	cnt := s.perEP[ep.Name()]
	cnt.Reads++
	note := func(kind string, detail any) {
		if len(s.examples) < 20 {
			s.examples = append(s.examples, fmt.Sprintf("%s %s via %s: %v", kind, name, ep.Name(), detail))
		}
	}
	switch {
	case excused:
		cnt.Excused++
	case err != nil && etcdLeaderLoss(err):
		cnt.LeaderLoss++
		note("failed in an etcd leader election", err)
	case err != nil && apierrors.IsNotFound(err):
		cnt.Missing++
		note("missing", err)
	case err != nil && isServerError(err):
		cnt.Unreadable++
		note("unreadable", err)
	case err != nil:
		cnt.Errors++
		note("error", err)
	default:
		if seq, ok := parseSeq(name, v); !ok || seq < before {
			cnt.Stale++
			note("stale", fmt.Sprintf("read %q, %d was acknowledged before the read", v, before))
		}
	}
}

// isServerError is a 5xx answer, or an answer the client could not decode.
func isServerError(err error) bool {
	var st apierrors.APIStatus
	if errors.As(err, &st) {
		return st.Status().Code >= 500
	}
	return apierrors.IsInternalError(err) || strings.Contains(err.Error(), "decode")
}

// SampleReport is what a Sampler read.
type SampleReport struct {
	PerEndpoint map[string]SampleCounts
	// Examples are the first failed or stale reads.
	Examples []string
}

// Total sums the endpoints' counts.
func (r SampleReport) Total() SampleCounts {
	var t SampleCounts
	for _, c := range r.PerEndpoint {
		t.Reads += c.Reads
		t.Unreadable += c.Unreadable
		t.Missing += c.Missing
		t.Stale += c.Stale
		t.Errors += c.Errors
		t.LeaderLoss += c.LeaderLoss
		t.Excused += c.Excused
	}
	return t
}

// Bad is the number of reads in rotation that failed or were stale.
func (c SampleCounts) Bad() int64 {
	return c.Unreadable + c.Missing + c.Stale + c.Errors + c.LeaderLoss
}

func (r SampleReport) String() string {
	var parts []string
	for _, name := range slices.Sorted(maps.Keys(r.PerEndpoint)) {
		c := r.PerEndpoint[name]
		part := fmt.Sprintf("%s: %d reads, %d unreadable, %d missing, %d stale, %d errors, %d excused",
			name, c.Reads, c.Unreadable, c.Missing, c.Stale, c.Errors, c.Excused)
		if c.LeaderLoss > 0 {
			part += fmt.Sprintf(", %d failed in an etcd leader election", c.LeaderLoss)
		}
		parts = append(parts, part)
	}
	return strings.Join(parts, "; ")
}

// Report returns the counts so far.
func (s *Sampler) Report() SampleReport {
	s.mu.Lock()
	defer s.mu.Unlock()
	r := SampleReport{PerEndpoint: map[string]SampleCounts{}, Examples: slices.Clone(s.examples)}
	for name, c := range s.perEP {
		r.PerEndpoint[name] = *c
	}
	return r
}

// Stop stops sampling and reports.
func (s *Sampler) Stop() SampleReport {
	s.cancel()
	s.wg.Wait()
	return s.Report()
}

// VerifyReport is the end-of-run comparison of what an endpoint serves with the
// workload's record.
type VerifyReport struct {
	Endpoint string
	// Objects is the number of Secrets listed.
	Objects int
	// Lost are acknowledged objects missing or holding an older value than their
	// last acknowledged write.
	Lost []string
	// Overwritten are objects holding a value their writer never wrote.
	Overwritten []string
}

// OK reports no lost or overwritten write.
func (r VerifyReport) OK() bool { return len(r.Lost) == 0 && len(r.Overwritten) == 0 }

func (r VerifyReport) String() string {
	return fmt.Sprintf("%s: %d objects, %d lost %v, %d overwritten %v", r.Endpoint, r.Objects,
		len(r.Lost), first(r.Lost, 5), len(r.Overwritten), first(r.Overwritten, 5))
}

func first(s []string, n int) []string { return s[:min(n, len(s))] }

// Verify lists the namespace's Secrets through ep (run it after the writers
// stopped) and checks that every object holds its last acknowledged value, or a
// later one whose write had an unknown outcome.
func (w *Workload) Verify(ctx context.Context, ep Endpoint) (VerifyReport, error) {
	rep := VerifyReport{Endpoint: ep.Name()}
	c, err := ep.Client()
	if err != nil {
		return rep, err
	}
	got := map[string]string{}
	opts := metav1.ListOptions{Limit: 500}
	for {
		rctx, cancel := context.WithTimeout(ctx, requestTimeout)
		l, err := c.CoreV1().Secrets(w.Namespace).List(rctx, opts)
		cancel()
		if err != nil {
			return rep, fmt.Errorf("listing through %s: %w", ep.Name(), err)
		}
		for _, s := range l.Items {
			got[s.Name] = string(s.Data[valueKey])
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	rep.Objects = len(got)
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, name := range slices.Sorted(maps.Keys(w.objects)) {
		r := w.objects[name]
		v, ok := got[name]
		if r.ackSeq == 0 {
			// A create with an unknown outcome: absent, or its first value.
			if ok && v != seqValue(name, 1) {
				rep.Overwritten = append(rep.Overwritten, fmt.Sprintf("%s=%q (never acknowledged)", name, v))
			}
			continue
		}
		seq, parsed := parseSeq(name, v)
		switch {
		case !ok:
			rep.Lost = append(rep.Lost, name+" (absent)")
		case !parsed:
			rep.Overwritten = append(rep.Overwritten, fmt.Sprintf("%s=%q", name, v))
		case seq < r.ackSeq:
			rep.Lost = append(rep.Lost, fmt.Sprintf("%s=%q, acknowledged #%d", name, v, r.ackSeq))
		case seq > r.ackSeq && !slices.Contains(r.unknown, seq):
			rep.Overwritten = append(rep.Overwritten, fmt.Sprintf("%s=%q, acknowledged #%d", name, v, r.ackSeq))
		}
	}
	return rep, nil
}
