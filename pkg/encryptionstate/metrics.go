package encryptionstate

import (
	"time"

	"k8s.io/component-base/metrics"
)

// Metrics are what keeping the EncryptionState current costs, for the benchmark
// notes and for an operator wondering whether it does anything.
type Metrics struct {
	publishes   *metrics.CounterVec
	buildTime   *metrics.Counter
	publishTime *metrics.Counter
}

// Results of a publish (label result).
const (
	resultWritten   = "written"
	resultUnchanged = "unchanged"
	resultFailed    = "failed"
)

// NewMetrics registers the metrics in reg.
func NewMetrics(reg metrics.KubeRegistry) (*Metrics, error) {
	m := &Metrics{
		publishes: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace: "rekey", Subsystem: "encryption_state", Name: "publishes_total",
			Help:           "Publishes of the EncryptionState by this apiserver while it led, by result (written, unchanged: the stored object matched, failed).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"result"}),
		buildTime: metrics.NewCounter(&metrics.CounterOpts{
			Namespace: "rekey", Subsystem: "encryption_state", Name: "build_seconds_total",
			Help:           "Time this apiserver spent building the EncryptionState from what it holds in memory.",
			StabilityLevel: metrics.ALPHA,
		}),
		publishTime: metrics.NewCounter(&metrics.CounterOpts{
			Namespace: "rekey", Subsystem: "encryption_state", Name: "publish_seconds_total",
			Help:           "Time this apiserver spent publishing a changed EncryptionState (a read and a compare-and-swap write).",
			StabilityLevel: metrics.ALPHA,
		}),
	}
	for _, c := range []metrics.Registerable{m.publishes, m.buildTime, m.publishTime} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func (m *Metrics) built(d time.Duration) {
	if m != nil {
		m.buildTime.Add(d.Seconds())
	}
}

func (m *Metrics) published(result string, d time.Duration) {
	if m != nil {
		m.publishes.WithLabelValues(result).Inc()
		m.publishTime.Add(d.Seconds())
	}
}
