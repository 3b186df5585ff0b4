package guard

import (
	"errors"

	"k8s.io/component-base/metrics"
)

// Metrics count the configurations the guards refuse, by check (label check: a Check).
// The series keep the names dashboards and alerts know: the cluster guard's refusals
// are rekey_cluster_guard_refusals_total, every other check's
// rekey_storage_guard_refusals_total. A refusal the override lets through is not
// counted. A nil *Metrics counts nothing.
type Metrics struct {
	storage, cluster *metrics.CounterVec
}

// NewMetrics creates the metrics and registers them in reg (nil: none).
func NewMetrics(reg metrics.KubeRegistry) (*Metrics, error) {
	if reg == nil {
		return nil, nil
	}
	vec := func(subsystem, help string) *metrics.CounterVec {
		return metrics.NewCounterVec(&metrics.CounterOpts{Namespace: "rekey", Subsystem: subsystem, Name: "guard_refusals_total", Help: help, StabilityLevel: metrics.ALPHA}, []string{"check"})
	}
	m := &Metrics{
		storage: vec("storage", "Configuration changes refused because they would drop a key that still encrypts stored data."),
		cluster: vec("cluster", "Configuration changes refused because they would drop a key another live apiserver still writes with or the cluster's storage migration still needs."),
	}
	// Each series shows its checks at 0 from the start, so that the first refusal is an
	// increase.
	for _, s := range []struct {
		vec    *metrics.CounterVec
		checks []Check
	}{{m.storage, []Check{Change, Startup, Decrypt, Retention}}, {m.cluster, []Check{Cluster}}} {
		if err := reg.Register(s.vec); err != nil {
			return nil, err
		}
		for _, c := range s.checks {
			s.vec.WithLabelValues(string(c))
		}
	}
	return m, nil
}

// Count counts err when it is a refusal (a *RefusedError), by its check, and returns it
// unchanged: what a guard returns passes through it.
func (m *Metrics) Count(err error) error {
	var r *RefusedError
	if m == nil || !errors.As(err, &r) {
		return err
	}
	v := m.storage
	if r.Check == Cluster {
		v = m.cluster
	}
	v.WithLabelValues(string(r.Check)).Inc()
	return err
}
