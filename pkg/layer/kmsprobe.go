package layer

import (
	"context"
	"fmt"
	"strings"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// kmsProbe decrypts, every interval, one stored object per KMS v2 (provider, key id)
// that the latest storage inventory counts, with the serving configuration but past
// every DEK cache (transformers.UncachedKMSReads): the plugin itself must decrypt the
// DEK source. A plugin that lost a key behind a stable key id (a deleted key version,
// an alias re-pointed to other material) keeps answering Status with that id, and the
// cached DEKs keep serving every read, until the cache drops them or the apiserver
// restarts: then every object under it is unreadable at once. The probe says so while
// there is still time to bring the key back. A plugin that does not answer is not a
// finding here (readiness and the KMS metrics report an outage).
type kmsProbe struct {
	inventory *migrate.InventoryStore
	client    func() *clientv3.Client
	config    func() *config.Config
	tr        value.ResourceTransformers
	events    interface {
		Event(events.Kind, string, string)
	}
	log klog.Logger
	m   *kmsProbeMetrics

	// failing is the finding of the last probe, by bucket; an Event is raised when a
	// bucket starts failing, and a log line when it stops.
	mu      sync.Mutex
	failing map[kmsProbeBucket]guard.DecryptFailure
}

type kmsProbeBucket struct{ resource, provider, keyIDHash string }

type kmsProbeMetrics struct {
	failing *metrics.GaugeVec
	// failingKeyIDs is the number of failing series of failing, always exposed (0) so
	// that an alert on it sees a healthy apiserver too.
	failingKeyIDs *metrics.Gauge
	last          *metrics.Gauge
}

func newKMSProbeMetrics(reg metrics.KubeRegistry) (*kmsProbeMetrics, error) {
	m := &kmsProbeMetrics{
		failing: metrics.NewGaugeVec(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "kms", Name: "decrypt_probe_failing",
			Help: "Stored objects per resource, KMS v2 provider and key id hash whose sample the provider's plugin answered but could not decrypt " +
				"in the latest decrypt probe (--kms-decrypt-probe-interval): they are read from cached DEKs only, and become unreadable when the cache drops them.",
			StabilityLevel: metrics.ALPHA,
		}, []string{"resource", "provider", "key_id_hash"}),
		failingKeyIDs: metrics.NewGauge(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "kms", Name: "decrypt_probe_failing_key_ids",
			Help: "KMS v2 key ids (per resource and provider) with stored objects whose sample the plugin answered but could not decrypt " +
				"in the latest decrypt probe; rekey_kms_decrypt_probe_failing names them.",
			StabilityLevel: metrics.ALPHA,
		}),
		last: metrics.NewGauge(&metrics.GaugeOpts{
			Namespace: "rekey", Subsystem: "kms", Name: "decrypt_probe_last_timestamp_seconds",
			Help: "When the latest KMS v2 decrypt probe ended (Unix seconds); 0 before the first.", StabilityLevel: metrics.ALPHA,
		}),
	}
	for _, c := range []metrics.Registerable{m.failing, m.failingKeyIDs, m.last} {
		if err := reg.Register(c); err != nil {
			return nil, err
		}
	}
	return m, nil
}

// Run probes every interval until ctx ends.
func (p *kmsProbe) Run(ctx context.Context, interval time.Duration) {
	t := time.NewTicker(interval)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
			p.once(ctx)
		}
	}
}

// once probes every KMS v2 key id of the latest inventory and reports what changed.
func (p *kmsProbe) once(ctx context.Context) {
	cli := p.client()
	if cli == nil {
		return
	}
	fs, err := guard.CheckDecrypt(ctx, p.inventory.Latest(), cli, p.config(), transformers.UncachedKMSReads(p.tr))
	if err != nil {
		p.log.V(2).Info("KMS decrypt probe could not read etcd; trying again at the next interval", "err", err)
		return
	}
	now := map[kmsProbeBucket]guard.DecryptFailure{}
	for _, f := range fs {
		if f.Unavailable {
			continue // an outage, not a lost key: nothing is known about the keyring
		}
		now[kmsProbeBucket{f.Resource, f.Provider, f.KeyIDHash}] = f
	}
	p.mu.Lock()
	before := p.failing
	p.failing = now
	p.mu.Unlock()
	for b, f := range now {
		p.m.failing.WithLabelValues(b.resource, b.provider, b.keyIDHash).Set(float64(f.Objects))
		if _, ok := before[b]; ok {
			continue
		}
		msg := kmsProbeMessage(f)
		p.log.Error(nil, msg)
		p.events.Event(events.Warning, events.ReasonKMSDecryptProbeFailed, msg)
	}
	for b := range before {
		if _, ok := now[b]; !ok {
			p.m.failing.DeleteLabelValues(b.resource, b.provider, b.keyIDHash)
			p.log.Info("A KMS plugin decrypts stored data under a key id again", "resource", b.resource, "provider", b.provider, "keyIDHash", b.keyIDHash)
		}
	}
	p.m.failingKeyIDs.Set(float64(len(now)))
	p.m.last.Set(float64(time.Now().UnixNano()) / 1e9)
}

// kmsProbeMessage says what failed, what it means and what to do, without the plugin's
// own words (they may name raw key ids).
func kmsProbeMessage(f guard.DecryptFailure) string {
	var b strings.Builder
	fmt.Fprintf(&b, "KMS decrypt probe: %s: %d objects are stored under kms provider %q key id %s, and its plugin cannot decrypt them (%s); ",
		f.Resource, f.Objects, f.Provider, f.KeyIDHash, f.Reason())
	b.WriteString("they are served from cached DEKs only and become unreadable when the cache drops them or the apiserver restarts: " +
		"restore the plugin's access to that key (a deleted key version, an alias pointed elsewhere), and do not restart apiservers until the probe passes")
	return b.String()
}
