package migrate

import (
	"math"
	"sync"

	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// Metric results of rewritten objects.
const (
	resultRewritten  = "rewritten"  // re-encrypted with the write key
	resultCurrent    = "current"    // already on the write key, left alone
	resultConflict   = "conflict"   // changed concurrently; re-read and retried or dropped
	resultGone       = "gone"       // deleted concurrently
	resultUnreadable = "unreadable" // could not be decrypted; left alone
)

// Metrics are the migration and inventory metrics, registered per registry (nothing is
// global). A nil *Metrics records nothing.
type Metrics struct {
	objects            *metrics.GaugeVec
	unreadable         *metrics.GaugeVec
	acknowledged       *metrics.GaugeVec
	inventoryTimestamp *metrics.Gauge
	inventoryDuration  *metrics.Gauge
	migrated           *metrics.CounterVec
	remaining          *metrics.GaugeVec
	running            *metrics.Gauge
	lastSuccess        *metrics.Gauge
	failures           *metrics.Counter
	paused             *metrics.GaugeVec
	allowedRate        *metrics.Gauge

	mu      sync.Mutex
	buckets map[string][][]string // resource → label sets set by the latest inventory
}

// NewMetrics creates the metrics and registers them in reg.
func NewMetrics(reg metrics.KubeRegistry) (*Metrics, error) {
	gauge := func(name, help string) *metrics.Gauge {
		return metrics.NewGauge(&metrics.GaugeOpts{Namespace: "rekey", Subsystem: "storage", Name: name, Help: help, StabilityLevel: metrics.ALPHA})
	}
	m := &Metrics{
		objects: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "objects",
			Help:           "Stored objects per resource, provider, key (key name or KMS provider name), KMS key id hash and state (current or stale), from the latest inventory.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource", "provider", "key", "key_id_hash", "state"}),
		unreadable: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "unreadable_objects",
			Help:           "Stored objects the current configuration cannot read, per resource, from the latest inventory.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource"}),
		acknowledged: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "unreadable_acknowledged_objects",
			Help:           "Unreadable stored objects an operator acknowledged, per resource, from the latest inventory: they no longer keep a migration unverified or a key in use.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource"}),
		inventoryTimestamp: gauge("inventory_last_timestamp_seconds", "When the latest inventory of stored objects was taken."),
		inventoryDuration:  gauge("inventory_duration_seconds", "How long the latest inventory took."),
		migrated: metrics.NewCounterVec(&metrics.CounterOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "migration_objects_total",
			Help:           "Objects visited by storage migration per resource and result (rewritten, current, conflict, gone, unreadable).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource", "result"}),
		remaining: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "migration_remaining_objects",
			Help:           "Objects of a resource the running migration has not visited yet (estimate).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource"}),
		running:     gauge("migration_running", "1 while a storage migration runs."),
		lastSuccess: gauge("migration_last_success_timestamp_seconds", "When a storage migration last finished with a verified re-scan showing no stale object."),
		failures:    metrics.NewCounter(&metrics.CounterOpts{Namespace: "rekey", Subsystem: "storage", Name: "migration_failures_total", Help: "Storage migrations that ended with an error.", StabilityLevel: metrics.ALPHA}),
		paused: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "storage", Name: "migration_paused",
			Help: "1 while the storage migration is paused, by reason: " + pace.PauseDBSize + " (etcd's database at --storage-migration-max-db-fraction of " +
				"--storage-migration-etcd-quota-bytes), " + pace.PauseNoSpace + " (etcd raised NOSPACE), " + pace.PauseUnknown + " (etcd's size could not be read).",
			StabilityLevel: metrics.ALPHA,
		}, []string{"reason"}),
		allowedRate: gauge("migration_allowed_rate", "Objects per second the storage migration's adaptive pacing allows now; 0 is no limit."),
		buckets:     map[string][][]string{},
	}
	cs := []metrics.Registerable{m.objects, m.unreadable, m.acknowledged, m.inventoryTimestamp, m.inventoryDuration, m.migrated, m.remaining, m.running, m.lastSuccess, m.failures, m.paused, m.allowedRate}
	for i, c := range cs {
		if err := reg.Register(c); err != nil {
			for _, done := range cs[:i] {
				reg.Unregister(done)
			}
			return nil, err
		}
	}
	return m, nil
}

// RecordInventory sets the inventory gauges from inv, an inventory this apiserver did
// not take itself (a cluster leader's verifying re-scan it adopted); TakeInventory
// records its own.
func (m *Metrics) RecordInventory(inv *Inventory) { m.recordInventory(inv) }

func (m *Metrics) recordInventory(inv *Inventory) {
	if m == nil || inv == nil {
		return
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	for _, r := range inv.Resources {
		for _, lv := range m.buckets[r.Resource] {
			m.objects.DeleteLabelValues(lv...)
		}
		sets := map[[5]string]float64{}
		for _, b := range r.Buckets {
			state := "current"
			if b.Stale {
				state = "stale"
			}
			key := b.Key
			if b.Other {
				key = "(other)"
			}
			sets[[5]string{r.Resource, b.Provider, key, b.KeyIDHash, state}] += float64(b.Objects)
		}
		var lvs [][]string
		for k, n := range sets {
			m.objects.WithLabelValues(k[:]...).Set(n)
			lvs = append(lvs, append([]string(nil), k[:]...))
		}
		m.buckets[r.Resource] = lvs
		m.unreadable.WithLabelValues(r.Resource).Set(float64(r.Unreadable))
		m.acknowledged.WithLabelValues(r.Resource).Set(float64(r.Acknowledged))
	}
	m.inventoryTimestamp.Set(float64(inv.TakenAt.UnixNano()) / 1e9)
	m.inventoryDuration.Set(inv.Duration.Seconds())
}

func (m *Metrics) object(resource, result string, n int) {
	if m == nil || n == 0 {
		return
	}
	m.migrated.WithLabelValues(resource, result).Add(float64(n))
}

func (m *Metrics) setRemaining(resource string, n int64) {
	if m == nil {
		return
	}
	m.remaining.WithLabelValues(resource).Set(float64(max(n, 0)))
}

func (m *Metrics) setRunning(on bool) {
	if m == nil {
		return
	}
	if on {
		m.running.Set(1)
	} else {
		m.running.Set(0)
	}
}

// setPaused sets the paused gauge of reason to 1 and the others to 0 ("": none).
func (m *Metrics) setPaused(reason string) {
	if m == nil {
		return
	}
	for _, r := range []string{pace.PauseDBSize, pace.PauseNoSpace, pace.PauseUnknown} {
		v := 0.0
		if r == reason {
			v = 1
		}
		m.paused.WithLabelValues(r).Set(v)
	}
}

// setAllowedRate records the pacer's rate (+Inf: no limit, shown as 0).
func (m *Metrics) setAllowedRate(r float64) {
	if m == nil {
		return
	}
	if math.IsInf(r, 1) {
		r = 0
	}
	m.allowedRate.Set(r)
}

func (m *Metrics) migrationDone(err error, now float64) {
	if m == nil {
		return
	}
	if err != nil {
		m.failures.Inc()
		return
	}
	m.lastSuccess.Set(now)
}
