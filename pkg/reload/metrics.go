package reload

import (
	"crypto/sha256"
	"encoding/hex"
	"sync"
	"time"

	"k8s.io/component-base/metrics"
)

// Metric names and labels are upstream's (encryption config controller), so dashboards
// and alerts written for kube-apiserver keep working.
const (
	metricsNamespace = "apiserver"
	metricsSubsystem = "encryption_config_controller"

	statusSuccess = "success"
	statusFailure = "failure"
)

// reloadMetrics records reload outcomes into one registry. Unlike upstream nothing is
// global: each Agent registers its own collectors.
type reloadMetrics struct {
	idHash   string
	reloads  *metrics.CounterVec
	lastTime *metrics.GaugeVec
	info     *configInfoCollector
	// fips is rekey_fips_mode: 1 when the agent builds in FIPS 140-3 mode.
	fips *metrics.Gauge
}

func newReloadMetrics(reg metrics.KubeRegistry, apiServerID string, fips bool) (*reloadMetrics, error) {
	m := &reloadMetrics{
		idHash: hashLabel(apiServerID),
		reloads: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace:      metricsNamespace,
			Subsystem:      metricsSubsystem,
			Name:           "automatic_reloads_total",
			Help:           "Total number of reload successes and failures of encryption configuration split by apiserver identity.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"status", "apiserver_id_hash"}),
		lastTime: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace:      metricsNamespace,
			Subsystem:      metricsSubsystem,
			Name:           "automatic_reload_last_timestamp_seconds",
			Help:           "Timestamp of the last successful or failed automatic reload of encryption configuration split by apiserver identity.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"status", "apiserver_id_hash"}),
		info: &configInfoCollector{desc: metrics.NewDesc(
			metrics.BuildFQName(metricsNamespace, metricsSubsystem, "last_config_info"),
			"Information about the last applied encryption configuration with hash as label, split by apiserver identity.",
			[]string{"apiserver_id_hash", "hash"}, nil, metrics.ALPHA, "")},
		fips: metrics.NewGauge(&metrics.GaugeOpts{
			Namespace: "rekey", Name: "fips_mode",
			Help:           "1 when the encryption layer runs in FIPS 140-3 mode and refuses providers outside the approved set (secretbox, KMS v1), else 0.",
			StabilityLevel: metrics.ALPHA,
		}),
	}
	if err := reg.Register(m.reloads); err != nil {
		return nil, err
	}
	if err := reg.Register(m.lastTime); err != nil {
		reg.Unregister(m.reloads)
		return nil, err
	}
	if err := reg.CustomRegister(m.info); err != nil {
		reg.Unregister(m.reloads)
		reg.Unregister(m.lastTime)
		return nil, err
	}
	if err := reg.Register(m.fips); err != nil {
		reg.Unregister(m.reloads)
		reg.Unregister(m.lastTime)
		return nil, err
	}
	if fips {
		m.fips.Set(1)
	} else {
		m.fips.Set(0)
	}
	return m, nil
}

func (m *reloadMetrics) record(status string, now time.Time, configHash string) {
	if m == nil {
		return
	}
	m.reloads.WithLabelValues(status, m.idHash).Inc()
	m.lastTime.WithLabelValues(status, m.idHash).Set(float64(now.UnixNano()) / 1e9)
	if status == statusSuccess {
		m.setConfig(configHash)
	}
}

func (m *reloadMetrics) setConfig(configHash string) {
	if m == nil {
		return
	}
	m.info.set(m.idHash, configHash)
}

// hashLabel is upstream's label form of an identity: "sha256:<hex>", or "" for "".
func hashLabel(s string) string {
	if s == "" {
		return ""
	}
	sum := sha256.Sum256([]byte(s))
	return "sha256:" + hex.EncodeToString(sum[:])
}

// configInfoCollector exposes one series, value 1, labelled with the active config hash.
type configInfoCollector struct {
	metrics.BaseStableCollector
	desc *metrics.Desc

	mu     sync.Mutex
	labels []string // apiserver_id_hash, hash; nil until a config is loaded
}

func (c *configInfoCollector) set(idHash, configHash string) {
	c.mu.Lock()
	c.labels = []string{idHash, configHash}
	c.mu.Unlock()
}

func (c *configInfoCollector) DescribeWithStability(ch chan<- *metrics.Desc) { ch <- c.desc }

func (c *configInfoCollector) CollectWithStability(ch chan<- metrics.Metric) {
	c.mu.Lock()
	labels := c.labels
	c.mu.Unlock()
	if labels == nil {
		return
	}
	ch <- metrics.NewLazyConstMetric(c.desc, metrics.GaugeValue, 1, labels...)
}
