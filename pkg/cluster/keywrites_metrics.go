package cluster

import (
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/reload"
)

// newKeyTotalMetrics are the cluster's per-key totals as gauges, labelled like
// rekey_key_writes_total: provider, key name, check (check value, or a KMS v2 key id's
// "sha256:" hash). Every apiserver exposes the same values; aggregate with max.
func newKeyTotalMetrics() (writes, writing, firstSeen *metrics.GaugeVec) {
	labels := []string{"provider", "key", "check"}
	writes = metrics.NewGaugeVec(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: "key_writes",
		Help:           "Values every apiserver of the cluster ever sealed with the key (the lifetime total in etcd; survives restarts).",
		StabilityLevel: metrics.ALPHA}, labels)
	writing = metrics.NewGaugeVec(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: "key_writing",
		Help:           "1 while some live apiserver writes with the key, 0 for a key only read.",
		StabilityLevel: metrics.ALPHA}, labels)
	firstSeen = metrics.NewGaugeVec(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "cluster", Name: "key_first_seen_timestamp_seconds",
		Help:           "When an apiserver of the cluster first configured the key: its age starts there.",
		StabilityLevel: metrics.ALPHA}, labels)
	return writes, writing, firstSeen
}

// setKeyTotals replaces the per-key gauges with totals; writing are the keys live
// members write with.
func (m *Metrics) setKeyTotals(totals []KeyTotal, writing []Key) {
	if m == nil {
		return
	}
	m.keyWrites.Reset()
	m.keyWriting.Reset()
	m.keyFirstSeen.Reset()
	for _, t := range totals {
		labels := []string{t.Provider, t.Key.Key, reload.KeyLabel(t.Key)}
		m.keyWrites.WithLabelValues(labels...).Set(float64(t.Writes))
		m.keyFirstSeen.WithLabelValues(labels...).Set(float64(t.FirstSeen.UnixNano()) / 1e9)
		w := 0.0
		for _, k := range writing {
			if k.SameKey(t.Key) && k.KeyIDHash == t.KeyIDHash {
				w = 1
			}
		}
		m.keyWriting.WithLabelValues(labels...).Set(w)
	}
}
