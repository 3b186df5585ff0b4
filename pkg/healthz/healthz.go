// Package healthz provides the single `kms-providers` health check of an apiserver whose
// encryption configuration can be reloaded. The check probes every KMS v2 provider of
// the active configuration; when the configuration is swapped, the set of probes is
// swapped with it (Swap), so the check keeps its name and its place on /healthz and
// /readyz for the life of the process.
//
// The check keeps no cache of its own: each provider's Check is the one cache in front
// of its plugin (kmsv2.Provider.Check serves a result 20 s after a success and 3 s after
// a failure, as upstream caches its KMS probes, and lets concurrent checks share one
// Status call). A second cache here would add its period to the provider's.
//
//	c := healthz.New(healthz.Options{})
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

	"github.com/rekey-io/rekey/pkg/config"
)

// Name is the check's name: it is served at /healthz/kms-providers and
// /readyz/kms-providers, as kube-apiserver does when automatic reload is on.
const Name = "kms-providers"

// DefaultTimeout bounds one provider's check, as upstream bounds its KMS probes.
const DefaultTimeout = config.DefaultKMSTimeout

// Probe is one KMS provider as the check sees it. transformers.KMSProvider satisfies it.
type Probe interface {
	// Name is the provider name from the configuration.
	Name() string
	// Check returns nil when the plugin is healthy. It is expected to cache its result
	// and to share one plugin call among concurrent checks; the Checker calls it for
	// every request.
	Check(ctx context.Context) error
}

// Options configure a Checker. Zero values take the defaults above.
type Options struct {
	// Timeout bounds one provider's check, within the request's own deadline.
	Timeout time.Duration
}

// Checker is the `kms-providers` check. It implements k8s.io/apiserver's
// healthz.HealthChecker. The zero value is not usable; use New.
type Checker struct {
	opts   Options
	probes atomic.Pointer[[]Probe]
}

// New returns a Checker with no providers: it passes until Swap installs some.
func New(opts Options) *Checker {
	if opts.Timeout <= 0 {
		opts.Timeout = DefaultTimeout
	}
	c := &Checker{opts: opts}
	c.probes.Store(&[]Probe{})
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

// Swap replaces the providers the check probes, in configuration order.
func (c *Checker) Swap(probes ...Probe) {
	list := append([]Probe(nil), probes...)
	c.probes.Store(&list)
}

// CheckContext probes every provider (in parallel) and returns nil when all are healthy. Otherwise the error names every failing
// provider by its index over the KMS providers in the file (kms-provider-<i>, upstream's
// naming) and by its configured name.
func (c *Checker) CheckContext(ctx context.Context) error {
	list := *c.probes.Load()
	switch len(list) {
	case 0:
		return nil
	case 1:
		return c.check(ctx, 0, list[0])
	}
	errs := make([]error, len(list))
	var wg sync.WaitGroup
	for i, p := range list {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[i] = c.check(ctx, i, p)
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

// check runs one provider's check within the timeout and names it in the error.
func (c *Checker) check(ctx context.Context, index int, p Probe) error {
	ctx, cancel := context.WithTimeout(ctx, c.opts.Timeout)
	defer cancel()
	if err := p.Check(ctx); err != nil {
		return fmt.Errorf("kms-provider-%d: provider %q: %w", index, p.Name(), err)
	}
	return nil
}
