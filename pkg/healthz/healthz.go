// Package healthz provides the single `kms-providers` health check of an apiserver whose
// encryption configuration can be reloaded. The check probes every KMS v2 provider of
// the active configuration; when the configuration is swapped, the set of probes is
// swapped with it (Swap), so the check keeps its name and its place on /healthz and
// /readyz for the life of the process.
//
// Results are cached per provider (20 s after a success, 3 s after a failure, as
// upstream caches its KMS probes) and concurrent probes of one provider share a single
// call, so a storm of health requests costs at most one plugin call per provider per
// cache period.
//
//	c := healthz.New(healthz.Options{Clock: clk})
//	c.Swap(set.KMSProviders()...)      // at start and after every reload
//	cfg.AddHealthzChecks(c); cfg.AddReadyzChecks(c) // never livez
package healthz

import (
	"context"
	"fmt"
	"net/http"
	"sync"
	"sync/atomic"
	"time"

	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/utils/clock"
)

// Name is the check's name: it is served at /healthz/kms-providers and
// /readyz/kms-providers, as kube-apiserver does when automatic reload is on.
const Name = "kms-providers"

// Cache periods and the per-call bound, as upstream's KMS probes use them.
const (
	DefaultOKTTL      = 20 * time.Second
	DefaultFailureTTL = 3 * time.Second
	DefaultTimeout    = 3 * time.Second
)

// Probe is one KMS provider as the check sees it. transformers.KMSProvider satisfies it.
type Probe interface {
	// Name is the provider name from the configuration.
	Name() string
	// Check returns nil when the plugin is healthy.
	Check(ctx context.Context) error
}

// Options configure a Checker. Zero values take the defaults above and the real clock.
type Options struct {
	Clock      clock.PassiveClock
	OKTTL      time.Duration
	FailureTTL time.Duration
	// Timeout bounds one provider call. A probe outlives the request that started it
	// (other requests may be waiting for its result), so only this bound applies.
	Timeout time.Duration
}

// Checker is the `kms-providers` check. It implements k8s.io/apiserver's
// healthz.HealthChecker. The zero value is not usable; use New.
type Checker struct {
	opts   Options
	probes atomic.Pointer[[]*cachedProbe]
}

// New returns a Checker with no providers: it passes until Swap installs some.
func New(opts Options) *Checker {
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.OKTTL <= 0 {
		opts.OKTTL = DefaultOKTTL
	}
	if opts.FailureTTL <= 0 {
		opts.FailureTTL = DefaultFailureTTL
	}
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	c := &Checker{opts: opts}
	c.probes.Store(&[]*cachedProbe{})
	return c
}

// Name returns "kms-providers".
func (c *Checker) Name() string { return Name }

// Check probes every provider of the current configuration; see CheckContext.
func (c *Checker) Check(r *http.Request) error {
	ctx := context.Background()
	if r != nil {
		ctx = r.Context()
	}
	return c.CheckContext(ctx)
}

// Swap replaces the providers the check probes, in configuration order. Results cached
// for the previous providers are dropped with them.
func (c *Checker) Swap(probes ...Probe) {
	list := make([]*cachedProbe, len(probes))
	for i, p := range probes {
		list[i] = &cachedProbe{index: i, probe: p}
	}
	c.probes.Store(&list)
}

// CheckContext probes every provider (in parallel, each served from its cache when
// fresh) and returns nil when all are healthy. Otherwise the error names every failing
// provider by its index over the KMS providers in the file (kms-provider-<i>, upstream's
// naming) and by its configured name.
func (c *Checker) CheckContext(ctx context.Context) error {
	list := *c.probes.Load()
	switch len(list) {
	case 0:
		return nil
	case 1:
		return list[0].describe(list[0].check(ctx, c))
	}
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, p := range list {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = p.describe(p.check(ctx, c))
		}()
	}
	wg.Wait()
	var failed []error
	for _, err := range errs {
		if err != nil {
			failed = append(failed, err)
		}
	}
	return utilerrors.Reduce(utilerrors.NewAggregate(failed))
}

// cachedProbe caches one provider's last result and lets concurrent callers share one
// call to the provider.
type cachedProbe struct {
	index int
	probe Probe

	mu       sync.Mutex
	valid    bool
	err      error
	at       time.Time
	inflight chan struct{} // closed when the running call stores its result
}

func (p *cachedProbe) describe(err error) error {
	if err == nil {
		return nil
	}
	return fmt.Errorf("kms-provider-%d: provider %q: %w", p.index, p.probe.Name(), err)
}

func (p *cachedProbe) fresh(c *Checker) bool {
	if !p.valid {
		return false
	}
	ttl := c.opts.OKTTL
	if p.err != nil {
		ttl = c.opts.FailureTTL
	}
	return c.opts.Clock.Since(p.at) < ttl
}

func (p *cachedProbe) check(ctx context.Context, c *Checker) error {
	p.mu.Lock()
	if p.fresh(c) {
		err := p.err
		p.mu.Unlock()
		return err
	}
	if wait := p.inflight; wait != nil {
		p.mu.Unlock()
		select {
		case <-wait:
			p.mu.Lock()
			err := p.err
			p.mu.Unlock()
			return err
		case <-ctx.Done():
			return fmt.Errorf("gave up waiting for the plugin's answer: %w", ctx.Err())
		}
	}
	done := make(chan struct{})
	p.inflight = done
	p.mu.Unlock()

	callCtx, cancel := context.WithTimeout(context.WithoutCancel(ctx), c.opts.Timeout)
	err := p.probe.Check(callCtx)
	cancel()

	p.mu.Lock()
	p.valid, p.err, p.at = true, err, c.opts.Clock.Now()
	p.inflight = nil
	close(done)
	p.mu.Unlock()
	return err
}
