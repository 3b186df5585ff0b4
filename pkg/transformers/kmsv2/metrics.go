package kmsv2

import (
	"sync"
	"time"

	"google.golang.org/grpc/codes"
	"k8s.io/component-base/metrics"
	"k8s.io/utils/lru"

	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// Metrics are the KMS v2 metrics of one registry, shared by every provider a factory
// builds. Upstream's names and labels where upstream has the metric, rekey_* otherwise.
type Metrics struct {
	rpcLatency     *metrics.HistogramVec
	cacheMisses    *metrics.Counter
	cacheSize      *metrics.GaugeVec
	invalidKeyID   *metrics.CounterVec
	statusKeyIDTS  *metrics.GaugeVec
	hits           *metrics.CounterVec
	misses         *metrics.CounterVec
	cacheEvictions *metrics.CounterVec
	rotations      *metrics.CounterVec
	healthy        *metrics.GaugeVec
	writeExpiry    *metrics.GaugeVec
	// firstSeedHoldExpired counts first DEK seeds written under after their hold's
	// bound, not because every apiserver's plugin reported the key id.
	firstSeedHoldExpired *metrics.CounterVec
	// seedCreated, seedWrites and seedRefreshes describe the write seed's lifetime
	// (FactoryOptions.SeedMaxAge, SeedMaxWrites); dekIdleExpired counts cache entries
	// dropped by FactoryOptions.DEKCacheIdle.
	seedCreated    *metrics.GaugeVec
	seedWrites     *metrics.GaugeVec
	seedRefreshes  *metrics.CounterVec
	dekIdleExpired *metrics.CounterVec
	// keyIDReuses, keyIDReused, keyIDDisagreements and keyIDFlaps are the key id rules'
	// findings (FactoryOptions.KeyIDConfirmations, SupersededKeyIDs).
	keyIDReuses        *metrics.CounterVec
	keyIDReused        *metrics.GaugeVec
	keyIDDisagreements *metrics.CounterVec
	keyIDFlaps         *metrics.CounterVec

	// live counts the open Providers per name. When the last one of a name closes (a
	// reload removed the provider), its health and write-expiry series are deleted: left
	// behind, a frozen expiry would raise the "write DEK about to expire" alert for a
	// provider that no longer exists. A reload that keeps the name opens the new
	// Provider before closing the old one, so the count never reaches zero there.
	liveMu sync.Mutex
	live   map[string]int

	// statusKeyIDs remembers the label sets of statusKeyIDTS, most recently used first;
	// evicting one deletes its series, so a plugin that changes key ids cannot grow the
	// metric without bound. statusKeyIDMu makes the Add and the Set of one series one
	// step for the other providers' Status loops (see statusKeyID).
	statusKeyIDMu sync.Mutex
	statusKeyIDs  *lru.Cache
}

// maxKeyIDHashSeries bounds the key id hash series kept per Metrics (all providers
// together), the bound kube-apiserver uses for the same metric.
const maxKeyIDHashSeries = 100

// keyIDSeries is one label set of statusKeyIDTS.
type keyIDSeries struct{ provider, keyIDHash, apiServerIDHash string }

// NewMetrics creates the metrics and registers them in reg when reg is not nil
// (unregistered metrics record nothing).
func NewMetrics(reg metrics.KubeRegistry) *Metrics {
	m := &Metrics{
		rpcLatency: metrics.NewHistogramVec(&metrics.HistogramOpts{
			Namespace: "apiserver", Subsystem: "envelope_encryption", Name: "kms_operations_latency_seconds",
			Help:           "KMS operation duration with gRPC error code status total.",
			Buckets:        metrics.ExponentialBuckets(0.0001, 2, 20),
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name", "method_name", "grpc_status_code"}),
		cacheMisses: metrics.NewCounter(&metrics.CounterOpts{
			Namespace: "apiserver", Subsystem: "storage", Name: "envelope_transformation_cache_misses_total",
			Help:           "Total number of cache misses while accessing key decryption key(KEK).",
			StabilityLevel: metrics.ALPHA,
		}),
		cacheSize: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "apiserver", Subsystem: "envelope_encryption", Name: "dek_source_cache_size",
			Help:           "Number of records in data encryption key (DEK) source cache. On a restart, this value is an approximation of the number of decrypt RPC calls the server will make to the KMS plugin.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		firstSeedHoldExpired: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace: "rekey", Subsystem: "kms", Name: "first_seed_hold_expired_total",
			Help:           "First DEK seeds of a KMS v2 provider written under after --kms-first-seed-hold expired, before every apiserver's KMS plugin reported their key id.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		seedCreated: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Name: "rekey_kmsv2_seed_created_timestamp_seconds", Help: "Unix time the current write DEK seed was made (its age is time() minus this; --kms-seed-max-age bounds it).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		seedWrites: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Name: "rekey_kmsv2_seed_writes", Help: "Values encrypted with the current write DEK seed, as of the provider loop's last wake (--kms-seed-max-writes bounds it).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		seedRefreshes: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_seed_refreshes_total", Help: "New write DEK seeds made under an unchanged key id, by the bound that asked for them (age, writes).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name", "reason"}),
		dekIdleExpired: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_dek_cache_idle_expirations_total", Help: "Decrypted DEK sources dropped from the cache after --kms-dek-cache-idle without a read.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		keyIDReuses: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_key_id_reuses_total", Help: "Times a KMS plugin reported a superseded key id again (a reuse), refused as a write key.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		keyIDReused: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Name: "rekey_kmsv2_key_id_reused", Help: "1 while the KMS plugin reports a refused reused key id, else 0.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		keyIDDisagreements: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_key_id_disagreements_total", Help: "Encrypt answers whose key id differed from the Status key id they were asked for (not followed).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		keyIDFlaps: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_key_id_flaps_total", Help: "New key ids a KMS plugin reported that went away before --kms-key-id-confirmations Status answers confirmed them (nothing was written under them).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		invalidKeyID: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace: "apiserver", Subsystem: "envelope_encryption", Name: "invalid_key_id_from_status_total",
			Help:           "Number of times an invalid keyID is returned by the Status RPC call split by error.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name", "error"}),
		statusKeyIDTS: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "apiserver", Subsystem: "envelope_encryption", Name: "key_id_hash_status_last_timestamp_seconds",
			Help:           "The last time in seconds when a keyID was returned by the Status RPC call.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name", "key_id_hash", "apiserver_id_hash"}),
		hits: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_dek_cache_hits_total", Help: "Reads whose DEK source was cached (no Decrypt RPC).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		misses: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_dek_cache_misses_total", Help: "Reads whose DEK source was not cached and needed a Decrypt RPC.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		cacheEvictions: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_dek_cache_evictions_total", Help: "DEK sources evicted from the bounded cache.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		rotations: metrics.NewCounterVec(&metrics.CounterOpts{
			Name: "rekey_kmsv2_dek_source_rotations_total", Help: "New write DEK sources (seeds) accepted after an Encrypt RPC.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		healthy: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Name: "rekey_kmsv2_healthy", Help: "1 when the last Status was fully healthy, else 0.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
		writeExpiry: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Name: "rekey_kmsv2_write_expiry_timestamp_seconds", Help: "Unix time after which writes fail unless a healthy Status arrives.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"provider_name"}),
	}
	m.statusKeyIDs = lru.NewWithEvictionFunc(maxKeyIDHashSeries, func(k lru.Key, _ any) {
		l := k.(keyIDSeries)
		m.statusKeyIDTS.DeleteLabelValues(l.provider, l.keyIDHash, l.apiServerIDHash)
	})
	if reg != nil {
		reg.MustRegister(m.rpcLatency, m.cacheMisses, m.cacheSize, m.invalidKeyID, m.statusKeyIDTS,
			m.hits, m.misses, m.cacheEvictions, m.rotations, m.healthy, m.writeExpiry, m.firstSeedHoldExpired,
			m.seedCreated, m.seedWrites, m.seedRefreshes, m.dekIdleExpired,
			m.keyIDReuses, m.keyIDReused, m.keyIDDisagreements, m.keyIDFlaps)
	}
	return m
}

// opened and closed count the Providers named provider (see live).
func (m *Metrics) opened(provider string) {
	m.liveMu.Lock()
	defer m.liveMu.Unlock()
	if m.live == nil {
		m.live = map[string]int{}
	}
	m.live[provider]++
}

func (m *Metrics) closed(provider string) {
	m.liveMu.Lock()
	defer m.liveMu.Unlock()
	if m.live[provider]--; m.live[provider] > 0 {
		return
	}
	delete(m.live, provider)
	m.healthy.DeleteLabelValues(provider)
	m.writeExpiry.DeleteLabelValues(provider)
	m.cacheSize.DeleteLabelValues(provider)
	m.seedCreated.DeleteLabelValues(provider)
	m.seedWrites.DeleteLabelValues(provider)
	m.keyIDReused.DeleteLabelValues(provider)
}

// newSeed records a new write DEK seed of provider.
func (m *Metrics) newSeed(provider string, w *state.WriteState) {
	m.seedCreated.WithLabelValues(provider).Set(float64(w.Created.UnixNano()) / float64(time.Second))
	m.seedWrites.WithLabelValues(provider).Set(0)
	if w.Refresh != "" {
		m.seedRefreshes.WithLabelValues(provider, w.Refresh).Inc()
	}
}

// statusKeyID records when provider's Status last returned a key id, keeping at most
// maxKeyIDHashSeries series: the least recently reported one is deleted first.
func (m *Metrics) statusKeyID(provider, keyIDHash, apiServerIDHash string, ts float64) {
	// Add first, so that the eviction of another series comes before this one's series
	// exists: a gather in between never sees more than maxKeyIDHashSeries (with the Set
	// first, TestKeyIDHashSeriesAreBounded once counted 101). Under the lock no other
	// Add can evict this label set before its Set.
	m.statusKeyIDMu.Lock()
	defer m.statusKeyIDMu.Unlock()
	m.statusKeyIDs.Add(keyIDSeries{provider, keyIDHash, apiServerIDHash}, nil)
	m.statusKeyIDTS.WithLabelValues(provider, keyIDHash, apiServerIDHash).Set(ts)
}

// providerMetrics holds one provider's pre-resolved children, so the data path records
// without allocating.
type providerMetrics struct {
	m         *Metrics
	name      string
	hits      metrics.CounterMetric
	misses    metrics.CounterMetric
	evictions metrics.CounterMetric
	size      metrics.GaugeMetric
	okLatency map[string]metrics.ObserverMetric
}

func (m *Metrics) forProvider(name string) *providerMetrics {
	pm := &providerMetrics{
		m: m, name: name,
		hits:      m.hits.WithLabelValues(name),
		misses:    m.misses.WithLabelValues(name),
		evictions: m.cacheEvictions.WithLabelValues(name),
		size:      m.cacheSize.WithLabelValues(name),
		okLatency: map[string]metrics.ObserverMetric{},
	}
	for _, method := range []string{client.MethodStatus, client.MethodEncrypt, client.MethodDecrypt} {
		pm.okLatency[method] = m.rpcLatency.WithLabelValues(name, method, codes.OK.String())
	}
	return pm
}

// ObserveRPC implements client.LatencyRecorder.
func (pm *providerMetrics) ObserveRPC(method string, code codes.Code, d time.Duration) {
	if code == codes.OK {
		if o, ok := pm.okLatency[method]; ok {
			o.Observe(d.Seconds())
			return
		}
	}
	pm.m.rpcLatency.WithLabelValues(pm.name, method, code.String()).Observe(d.Seconds())
}

func (pm *providerMetrics) miss() {
	pm.misses.Inc()
	pm.m.cacheMisses.Inc()
}

// RPCRecorder returns the latency recorder for provider's gRPC client, for callers that
// build a client.Client directly (the benchmark harness, tools).
func (m *Metrics) RPCRecorder(provider string) client.LatencyRecorder { return m.forProvider(provider) }
