package transformers

import (
	"errors"
	"time"

	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/component-base/metrics"
)

// Metrics records upstream's storage transformation metrics
// (apiserver_storage_transformation_{operations_total,duration_seconds}) with upstream's
// names and labels, so existing dashboards keep working. Unlike upstream it is created
// per registry (no global registration), and the label children of the success path are
// resolved when a Set is built, so recording costs no allocation per operation.
//
// One deliberate difference: identity writes are labelled transformer_prefix="identity"
// (upstream labels them "" on writes and "identity" on reads).
type Metrics struct {
	operations *metrics.CounterVec
	duration   *metrics.HistogramVec
}

// NewMetrics creates the metrics and registers them in reg.
func NewMetrics(reg metrics.KubeRegistry) *Metrics {
	m := &Metrics{
		operations: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace:      "apiserver",
			Subsystem:      "storage",
			Name:           "transformation_operations_total",
			Help:           "Total number of transformations. Successful transformation will have a status 'OK' and a varied status string when the transformation fails.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource", "transformation_type", "transformer_prefix", "status"}),
		duration: metrics.NewHistogramVec(&metrics.HistogramOpts{
			Namespace:      "apiserver",
			Subsystem:      "storage",
			Name:           "transformation_duration_seconds",
			Help:           "Latencies in seconds of value transformation operations.",
			Buckets:        metrics.ExponentialBuckets(5e-6, 2, 25),
			StabilityLevel: metrics.ALPHA,
		}, []string{"transformation_type", "transformer_prefix"}),
	}
	reg.MustRegister(m.operations, m.duration)
	return m
}

const (
	toStorage   = "to_storage"
	fromStorage = "from_storage"
)

// observers holds the pre-resolved children for one provider of one resource rule.
type observers struct {
	m                 *Metrics
	resource, prefix  string
	writeOK, readOK   metrics.CounterMetric
	writeDur, readDur metrics.ObserverMetric
}

func (m *Metrics) observersFor(gr schema.GroupResource, prefix string) *observers {
	res := gr.String()
	return &observers{
		m: m, resource: res, prefix: prefix,
		writeOK:  m.operations.WithLabelValues(res, toStorage, prefix, "OK"),
		readOK:   m.operations.WithLabelValues(res, fromStorage, prefix, "OK"),
		writeDur: m.duration.WithLabelValues(toStorage, prefix),
		readDur:  m.duration.WithLabelValues(fromStorage, prefix),
	}
}

func now() time.Time { return time.Now() }

func (o *observers) write(start time.Time, err error) {
	if err == nil {
		o.writeOK.Inc()
		o.writeDur.Observe(time.Since(start).Seconds())
		return
	}
	o.m.operations.WithLabelValues(o.resource, toStorage, o.prefix, statusLabel(err)).Inc()
}

func (o *observers) read(start time.Time, err error) {
	if err == nil {
		o.readOK.Inc()
		o.readDur.Observe(time.Since(start).Seconds())
		return
	}
	o.m.operations.WithLabelValues(o.resource, fromStorage, o.prefix, statusLabel(err)).Inc()
}

// unknown records a read that no provider's prefix matched, as upstream does.
func (o *observers) unknown() {
	o.m.operations.WithLabelValues(o.resource, fromStorage, "unknown", "unknown-non-grpc").Inc()
}

// statusLabel is the gRPC code name when the error carries one, else unknown-non-grpc.
func statusLabel(err error) string {
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(err, &se) {
		return se.GRPCStatus().Code().String()
	}
	return "unknown-non-grpc"
}
