package cluster

import (
	"k8s.io/component-base/metrics"
)

// Metrics are the cluster metrics, registered per registry. A nil *Metrics records
// nothing.
type Metrics struct {
	members      *metrics.Gauge
	converged    *metrics.Gauge
	alarm        *metrics.Gauge
	fenceHeld    *metrics.GaugeVec
	migrationObj *metrics.GaugeVec
	leader       *metrics.Gauge
	keyWrites    *metrics.GaugeVec
	keyWriting   *metrics.GaugeVec
	keyFirstSeen *metrics.GaugeVec
}

// NewMetrics creates the metrics and registers them in reg (nil: none).
func NewMetrics(reg metrics.KubeRegistry) (*Metrics, error) {
	if reg == nil {
		return nil, nil
	}
	gauge := func(name, help string) *metrics.Gauge {
		return metrics.NewGauge(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: name, Help: help, StabilityLevel: metrics.ALPHA})
	}
	m := &Metrics{
		members:   gauge("members", "Live apiservers publishing their encryption state under the coordination prefix."),
		converged: gauge("converged", "1 when every live apiserver writes every resource with the same key, no write key is held back and no migration is due or running."),
		alarm:     gauge("disagreement_alarm", "1 when the live apiservers have disagreed about a write key for longer than --cluster-disagreement-alarm."),
		fenceHeld: metrics.NewGaugeVec(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: "fence_held_seconds",
			Help: "How long this apiserver's write fence has held the configured write key of a resource back (0 when not held).", StabilityLevel: metrics.ALPHA},
			[]string{"resource"}),
		migrationObj: metrics.NewGaugeVec(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: "migration_objects",
			Help: "Progress of the cluster's running storage migration: objects done and total of the current pass, per resource.", StabilityLevel: metrics.ALPHA},
			[]string{"resource", "state"}),
		leader: gauge("migration_leader", "1 on the apiserver elected to run storage migration."),
		// The cluster guard's refusals are counted by pkg/guard's Metrics
		// (rekey_cluster_guard_refusals_total), with every other guard's.
	}
	m.keyWrites, m.keyWriting, m.keyFirstSeen = newKeyTotalMetrics()
	for _, c := range []metrics.Registerable{m.members, m.converged, m.alarm, m.fenceHeld, m.migrationObj, m.leader, m.keyWrites, m.keyWriting, m.keyFirstSeen} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
