package reload

import (
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// KeyWritesMetric is the name of the per-key write counter this apiserver exposes.
const KeyWritesMetric = "rekey_key_writes_total"

// keyWritesCollector exposes transformers.WriteCounts as rekey_key_writes_total, read
// at scrape time so the write path pays only its atomic add. Labels name the key:
// provider, key name, and check: the check value of a local key or the "sha256:" hash
// of a KMS v2 key id — never key material.
type keyWritesCollector struct {
	metrics.BaseStableCollector
	desc   *metrics.Desc
	counts *transformers.WriteCounts
}

func newKeyWritesCollector(counts *transformers.WriteCounts) *keyWritesCollector {
	return &keyWritesCollector{counts: counts, desc: metrics.NewDesc(KeyWritesMetric,
		"Values this apiserver sealed with each key since it started (resets with the process; the cluster's lifetime total is rekey_cluster_key_writes).",
		[]string{"provider", "key", "check"}, nil, metrics.ALPHA, "")}
}

func (c *keyWritesCollector) DescribeWithStability(ch chan<- *metrics.Desc) { ch <- c.desc }

func (c *keyWritesCollector) CollectWithStability(ch chan<- metrics.Metric) {
	for _, k := range c.counts.Snapshot() {
		ch <- metrics.NewLazyConstMetric(c.desc, metrics.CounterValue, float64(k.Writes), k.Provider, k.Key, KeyLabel(k.KeyInfo))
	}
}

// KeyLabel is the check label of k: its check value, or for KMS v2 its key id hash.
func KeyLabel(k transformers.KeyInfo) string {
	if k.Check != "" {
		return k.Check
	}
	return k.KeyIDHash
}

// WriteCounts are the agent's per-key write counters (Options.Transformers.WriteCounts,
// created by NewAgent when not given): every Set the agent builds counts into them.
func (a *Agent) WriteCounts() *transformers.WriteCounts { return a.opts.Transformers.WriteCounts }
