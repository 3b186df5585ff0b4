package transformers

import (
	"errors"
	"strings"
	"time"

	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv1"
)

// Metrics records upstream's storage transformation metrics
// (apiserver_storage_transformation_{operations_total,duration_seconds}) with upstream's
// names and labels, so existing dashboards keep working. Unlike upstream it is created
// per registry (no global registration), and the label children of the success path are
// resolved when a Set is built, so recording costs no allocation per operation.
//
// One deliberate difference: identity writes are labelled transformer_prefix="identity"
// (upstream labels them "" on writes and "identity" on reads).
//
// It also counts the values read with AES-CBC (rekey_storage_transformation_cbc_reads_total):
// the aescbc provider, and KMS v1 values written before Kubernetes 1.25. CBC is
// unauthenticated; the count shows where it is still read, and its failures (a wrong key,
// a corrupted or a forged value) where someone may be probing it.
type Metrics struct {
	operations *metrics.CounterVec
	duration   *metrics.HistogramVec
	cbcReads   *metrics.CounterVec
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
		cbcReads: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace:      "rekey",
			Subsystem:      "storage_transformation",
			Name:           "cbc_reads_total",
			Help:           "Values read from storage with AES-CBC (the aescbc provider; KMS v1 values written before Kubernetes 1.25), by status: OK, or failed (wrong key, corrupted or forged value). CBC is unauthenticated: migrate these values to aesgcm, secretbox or KMS v2.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource", "transformer_prefix", "status"}),
	}
	reg.MustRegister(m.operations, m.duration, m.cbcReads)
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
	// cbc says which of the provider's reads are AES-CBC reads; cbcOK counts them.
	cbc   cbcReads
	cbcOK metrics.CounterMetric
}

// cbcReads says which reads of a provider are AES-CBC reads.
type cbcReads int

const (
	noCBC    cbcReads = iota
	allCBC            // aescbc: every read
	kmsv1CBC          // KMS v1: a stale read (CBC data), or a failure of both ciphers
)

// cbcFailed is the status of a CBC read that failed.
const cbcFailed = "failed"

func (m *Metrics) observersFor(gr schema.GroupResource, prefix string) *observers {
	res := gr.String()
	o := &observers{
		m: m, resource: res, prefix: prefix,
		writeOK:  m.operations.WithLabelValues(res, toStorage, prefix, "OK"),
		readOK:   m.operations.WithLabelValues(res, fromStorage, prefix, "OK"),
		writeDur: m.duration.WithLabelValues(toStorage, prefix),
		readDur:  m.duration.WithLabelValues(fromStorage, prefix),
	}
	switch {
	case prefix == AESCBCPrefix:
		o.cbc = allCBC
	case strings.HasPrefix(prefix, kmsv1.Prefix):
		o.cbc = kmsv1CBC
	}
	if o.cbc != noCBC {
		o.cbcOK = m.cbcReads.WithLabelValues(res, prefix, "OK")
	}
	return o
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

// read records a read by the provider; stale is what its Open said.
func (o *observers) read(start time.Time, stale bool, err error) {
	o.countCBC(stale, err)
	if err == nil {
		o.readOK.Inc()
		o.readDur.Observe(time.Since(start).Seconds())
		return
	}
	o.m.operations.WithLabelValues(o.resource, fromStorage, o.prefix, statusLabel(err)).Inc()
}

// countCBC counts a read that decrypted AES-CBC (or failed to).
func (o *observers) countCBC(stale bool, err error) {
	switch {
	case o.cbc == noCBC:
	case o.cbc == kmsv1CBC && err == nil && !stale:
		// AES-GCM data, as Kubernetes 1.25 and later write it.
	case o.cbc == kmsv1CBC && err != nil && !errors.Is(err, kmsv1.ErrUndecryptable):
		// The plugin or the framing failed before any data was decrypted.
	case err == nil:
		o.cbcOK.Inc()
	default:
		o.m.cbcReads.WithLabelValues(o.resource, o.prefix, cbcFailed).Inc()
	}
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
