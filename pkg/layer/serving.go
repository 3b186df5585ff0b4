package layer

import (
	"net/http"
	"time"

	"k8s.io/apiserver/pkg/endpoints/request"
	genericapiserver "k8s.io/apiserver/pkg/server"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// AddServingLatency makes the handler chain of c time every request it answers, so
// that storage migrations slow down when they slow the apiserver's clients
// (pace.Options.Serving): on a control plane whose CPUs etcd, the apiserver
// and the migration share, etcd can stay fast while the clients wait. Watches and
// other long-running requests (c.LongRunningFunc) are not timed. Each request is
// judged in its class (pace.ClassOf its verb: GETs, single-object writes, LISTs, other)
// against that class's own baseline. Call it on the config
// of the server that answers the clients: the only one in a single server, the
// aggregator's in kube-apiserver (its delegates' chains never run).
func (l *Layer) AddServingLatency(c *genericapiserver.Config) {
	if l.agent == nil || l.serving == nil {
		return
	}
	next := c.BuildHandlerChainFunc
	c.BuildHandlerChainFunc = func(apiHandler http.Handler, c *genericapiserver.Config) http.Handler {
		return next(timeServing(apiHandler, c.LongRunningFunc, l.serving.Observe), c)
	}
}

// timeServing wraps the innermost handler, where the chain has resolved the request
// and recorded when it arrived: the time observed runs from its arrival (through
// authentication, priority and fairness's queues) to its answer.
func timeServing(h http.Handler, longRunning request.LongRunningRequestCheck, observe func(pace.RequestClass, time.Duration)) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		ctx := r.Context()
		info, ok := request.RequestInfoFrom(ctx)
		if !ok || info.Verb == "watch" || (longRunning != nil && longRunning(r, info)) {
			h.ServeHTTP(w, r)
			return
		}
		arrived, ok := request.ReceivedTimestampFrom(ctx)
		if !ok {
			arrived = time.Now()
		}
		h.ServeHTTP(w, r)
		observe(pace.ClassOf(info.IsResourceRequest, info.Verb), time.Since(arrived))
	})
}
