package server

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"
)

// metrics are the plugin's Prometheus metrics, registered on the registry the caller
// passes (never the global one). They carry method names and version numbers only.
type metrics struct {
	requests *prometheus.CounterVec
	duration *prometheus.HistogramVec
	logins   *prometheus.CounterVec
	healthy  prometheus.Gauge
	current  prometheus.Gauge
}

func newMetrics(reg prometheus.Registerer) (*metrics, error) {
	m := &metrics{
		requests: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rekey_kms_pkcs11_requests_total",
			Help: "KMS v2 calls answered, by method and result (ok or error; a Status reporting unhealthy is an error).",
		}, []string{"method", "result"}),
		duration: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "rekey_kms_pkcs11_request_duration_seconds",
			Help:    "Time to answer a KMS v2 call, by method.",
			Buckets: prometheus.ExponentialBuckets(0.0001, 2, 16),
		}, []string{"method"}),
		logins: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rekey_kms_pkcs11_login_attempts_total",
			Help: "Logins to the token attempted, by result (ok or failed); at most one per --login-retry-interval.",
		}, []string{"result"}),
		healthy: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "rekey_kms_pkcs11_healthy",
			Help: "1 when logged in and the last seal/open probe succeeded, else 0.",
		}),
		current: prometheus.NewGauge(prometheus.GaugeOpts{
			Name: "rekey_kms_pkcs11_current_version",
			Help: "The key version Encrypt seals with.",
		}),
	}
	if reg != nil {
		for _, c := range []prometheus.Collector{m.requests, m.duration, m.logins, m.healthy, m.current} {
			if err := reg.Register(c); err != nil {
				return nil, err
			}
		}
	}
	return m, nil
}

func (m *metrics) observe(method string, ok bool, d time.Duration) {
	result := "ok"
	if !ok {
		result = "error"
	}
	m.requests.WithLabelValues(method, result).Inc()
	m.duration.WithLabelValues(method).Observe(d.Seconds())
}
