package testbed

import (
	"context"
	"sync"
	"time"
)

// Ready reports whether the shim's current process answers /readyz with 200 now. The
// workload asks it about a failed request when told to excuse members that are not
// ready (SamplerConfig.ExcuseNotReady), as a load balancer would not have sent it.
func (s *FleetShim) Ready(ctx context.Context) bool {
	sh := s.Current()
	if sh == nil || !s.Alive() {
		return false
	}
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	return sh.Readyz(ctx) == nil
}

// readinessChecker is an Endpoint that can say whether it is ready now.
type readinessChecker interface {
	Ready(ctx context.Context) bool
}

// notReadyNow reports whether ep says it is not ready now (false when it cannot say).
func notReadyNow(ctx context.Context, ep Endpoint) bool {
	rc, ok := ep.(readinessChecker)
	return ok && !rc.Ready(ctx)
}

// LoadBalancer plays a load balancer's health check in front of a fleet: every
// interval it asks each running shim's /readyz and puts the shim into rotation while
// it answers 200, out while it does not. It records every answer that was not 200, so
// a test can say which members were ever not ready.
type LoadBalancer struct {
	cancel context.CancelFunc
	done   chan struct{}

	mu       sync.Mutex
	notReady map[string][]string
}

// StartLoadBalancer starts the health checks until Stop.
func (f *Fleet) StartLoadBalancer(ctx context.Context, interval time.Duration) *LoadBalancer {
	ctx, cancel := context.WithCancel(ctx)
	lb := &LoadBalancer{cancel: cancel, done: make(chan struct{}), notReady: map[string][]string{}}
	go func() {
		defer close(lb.done)
		for ctx.Err() == nil {
			for _, s := range f.Shims {
				sh := s.Current()
				if sh == nil || !s.Alive() {
					continue
				}
				cctx, ccancel := context.WithTimeout(ctx, 5*time.Second)
				err := sh.Readyz(cctx)
				ccancel()
				if ctx.Err() != nil {
					return
				}
				s.SetInRotation(err == nil)
				if err != nil {
					lb.mu.Lock()
					lb.notReady[s.ID] = append(lb.notReady[s.ID], time.Now().Format("15:04:05.000")+" "+err.Error())
					lb.mu.Unlock()
				}
			}
			select {
			case <-ctx.Done():
			case <-time.After(interval):
			}
		}
	}()
	return lb
}

// NotReady returns the answers of shim id that were not 200, with their times, and
// forgets them: the next call reports only what happened since.
func (lb *LoadBalancer) NotReady(id string) []string {
	lb.mu.Lock()
	defer lb.mu.Unlock()
	out := lb.notReady[id]
	delete(lb.notReady, id)
	return out
}

// Stop ends the health checks; every shim keeps its last rotation state.
func (lb *LoadBalancer) Stop() {
	lb.cancel()
	<-lb.done
}
