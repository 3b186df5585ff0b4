// Package kmsv2 is the KMS v2 envelope provider: stored values are byte-compatible with
// kube-apiserver's (`k8s:enc:kms:v2:<name>:` ‖ protobuf EncryptedObject), in both
// directions and for both DEK source types, and the stale flag means the same.
//
// Differences from kube-apiserver, all behind the same bytes:
//   - writes derive one AES-256-GCM key per generation (≤2^32 writes) from the seed and
//     use a counter nonce, instead of one HKDF per write (docs/kmsv2-crypto.md);
//   - a write is one allocation and retains nothing;
//   - the DEK cache is bounded and reads never depend on plugin health;
//   - a read whose DEK is not cached never waits for a connection to the plugin: with
//     the plugin absent or gone it fails at once with transformers.ErrKMSUnavailable
//     naming provider, endpoint and since when (Unavailable; docs/kms-outage.md), and
//     writes without a seed or past the window are refused with a 503 and Retry-After;
//   - an unhealthy Status never extends the write window (kubernetes/kubernetes#138950).
//   - a seed is replaced after SeedMaxAge or SeedMaxWrites under a stable key id, and a
//     decrypted DEK source no read used for DEKCacheIdle leaves the cache
//     (docs/kmsv2-crypto.md, "How long a seed lives");
//   - Preflight checks a plugin before a configuration naming it is written.
//
// Use it through the factory:
//
//	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: reg})})
package kmsv2

import (
	"context"
	"crypto/cipher"
	"crypto/fips140"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"github.com/google/uuid"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/events"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// Defaults of FactoryOptions.
const (
	DefaultDEKCacheEntries  = 1024
	DefaultAEADCacheEntries = 256
	// Check serves a health result from cache this long after a success / a failure.
	DefaultHealthyTTL   = 20 * time.Second
	DefaultUnhealthyTTL = 3 * time.Second
	// DefaultSeedMaxAge: a DEK seed writes for at most a day while the key id is stable.
	// Upstream never replaces a seed without a key id change; a day is its DEK cache's
	// lifetime, and costs every other apiserver one Decrypt per seed per day.
	DefaultSeedMaxAge = 24 * time.Hour
	// DefaultSeedMaxWrites: at most 2^32 values per seed, the NIST SP 800-38D bound
	// for one AES-GCM key under random nonces that upstream cites, and the values one
	// derived key encrypts here (maxWritesPerGeneration): one seed never protects more
	// than one derived key's worth. See docs/kmsv2-crypto.md.
	DefaultSeedMaxWrites = 1 << 32
	// DefaultDEKCacheIdle: a decrypted DEK source no read used for a day leaves the
	// cache. Upstream drops every entry a day after it was cached, used or not; an
	// idle bound of the same length never drops an entry sooner than upstream would.
	DefaultDEKCacheIdle = 24 * time.Hour
)

// FactoryOptions configure every provider a factory builds.
type FactoryOptions struct {
	// Registry receives the KMS v2 metrics; nil records nothing.
	Registry metrics.KubeRegistry
	// Metrics, when set, is used instead of creating metrics from Registry. Use it when
	// several factories share one registry.
	Metrics *Metrics
	// DEKCacheEntries bounds the cache of decrypted DEK sources per provider.
	DEKCacheEntries int
	// AEADCacheEntries bounds the cache of derived keys per provider.
	AEADCacheEntries int
	// StatusInterval, RetryInterval and WriteTTL override the lifecycle defaults
	// (1 min, 10 s, 3 min); for tests.
	StatusInterval, RetryInterval, WriteTTL time.Duration
	// HealthyTTL and UnhealthyTTL: how long Check serves a result from cache (20 s, 3 s).
	HealthyTTL, UnhealthyTTL time.Duration
	// WritesPerGeneration bounds writes per derived key (default 2^32); for tests.
	WritesPerGeneration uint64
	// RandomNonces seals every value under a nonce drawn at random (Go's
	// cipher.NewGCMWithRandomNonce) instead of the generation's counter, and opens with
	// the same construction. The stored bytes have the same layout (info ‖ nonce ‖
	// ciphertext ‖ tag), so either reads the other's values and kube-apiserver reads
	// both. New turns it on in FIPS mode (transformers.Options.FIPS, or the process's
	// crypto/fips140.Enabled()): under transformers.FIPSOnly Go refuses AES-GCM
	// with a nonce the caller supplies (cipher.NewGCM), and under FIPSOn too only a
	// nonce the module draws makes the encryption an approved service (SP 800-38D
	// 8.2.2). Set here, it tests that path in any mode. See docs/kmsv2-crypto.md.
	RandomNonces bool
	// SeedMaxAge and SeedMaxWrites bound how long and for how many values one DEK seed
	// writes while the plugin's key id is stable (DefaultSeedMaxAge,
	// DefaultSeedMaxWrites); then a new seed is made off the request path, as for a key
	// id change. Zero keeps the default, negative means no bound.
	SeedMaxAge    time.Duration
	SeedMaxWrites int64
	// DEKCacheIdle drops a decrypted DEK source from the cache once no read has used
	// it for this long (DefaultDEKCacheIdle); zero keeps the default, negative never.
	// The next read of a value under it asks the plugin's Decrypt again.
	DEKCacheIdle time.Duration
	// OnKeyIDChange, when set, is called with the provider name and the new key id's
	// "sha256:<hex>" hash whenever a provider starts writing under another key id than
	// before (including its first). It runs on the provider's loop and must only
	// signal, never block (a cluster publishes the change to the other apiservers).
	OnKeyIDChange func(provider, keyIDHash string)
	// MayWriteKeyID, when set, is the cluster's write fence for key ids: a provider
	// whose plugin reports a new key id keeps writing with its current DEK seed
	// (wrapped under the old key id) until MayWriteKeyID(provider, "sha256:<hex>")
	// returns true, i.e. every other live apiserver's plugin reports that key id. It
	// is asked after every Status that reports a held key id and every
	// FenceRecheckInterval while one is held; it runs on the provider's loop and must
	// not block. The first DEK seed has no older one to keep writing with: it is only
	// held for a bounded time (FirstSeedHold). OnKeyIDChange is also called when the plugin reports a new key id, so the
	// other apiservers learn it at once.
	MayWriteKeyID func(provider, keyIDHash string) bool
	// FenceRecheckInterval is how often a held key id is checked again (default 500 ms).
	FenceRecheckInterval time.Duration
	// FirstSeedHold, with MayWriteKeyID, holds writes under a provider's first DEK
	// seed (at start, or built by a reload) until MayWriteKeyID opens for its key id,
	// for at most this long: Seal answers 503 meanwhile and Status reports
	// FirstSeedHeldUntil. At the bound writes go ahead under that key id, with an error
	// log and rekey_kms_first_seed_hold_expired_total. Zero: no hold.
	FirstSeedHold time.Duration
	// KeyIDConfirmations is how many consecutive healthy Status answers must report a
	// new key id before it acts: a new DEK seed, a fence hold, what migration follows
	// (DefaultKeyIDConfirmations; 1: the first one). The first DEK seed, and one after
	// the write window expired, are taken at once: nothing else can write.
	KeyIDConfirmations int
	// SupersededKeyIDs, when set, names the "sha256:<hex>" hashes of provider's key ids
	// that were written with and then replaced by another one (the cluster's key
	// ledger): the plugin reporting one again is a reuse, refused as a write key. The
	// provider also remembers the key ids it rotated away from itself. It is asked on
	// the provider's loop before every Status and must not block.
	SupersededKeyIDs func(provider string) []string
	// Events receives a Warning for a refused key id reuse and for a Status/Encrypt key
	// id disagreement; nil sends none.
	Events events.Sink
}

// DefaultFenceRecheckInterval is FactoryOptions.FenceRecheckInterval's default.
const DefaultFenceRecheckInterval = 500 * time.Millisecond

// Provider is one KMS v2 provider. It implements transformers.KMSProvider.
type Provider struct {
	name     string
	endpoint string
	prefix   []byte
	opts     FactoryOptions
	clock    clock.Clock
	log      klog.Logger
	apiID    string

	client *client.Client
	pm     *providerMetrics
	dek    *dekCache
	aeads  *aeadCache
	// recent maps the stored identity fields (everything after a leading field 1:
	// key id, DEK source, annotations, type — verbatim) of recently read values to their
	// DEK entry. It spares the common read of a value from another generation (another
	// apiserver, or before a restart) the SHA-256 cache key. Copy-on-write, so reads take
	// no lock; bounded by recentTails.
	recent   atomic.Pointer[map[string]*dekEntry]
	recentMu sync.Mutex

	write atomic.Pointer[writeState]
	view  atomic.Pointer[state.View]
	// down is the current outage of the plugin (nil while it answers, or before
	// anything tried): reads and Unavailable name it.
	down atomic.Pointer[outage]
	// coarseNow is the loop's clock as of its last wake (unix nanoseconds): reads stamp
	// the DEK entries they use with it instead of reading the clock per read.
	coarseNow atomic.Int64
	// seedFull wakes the loop when the write seed reached SeedMaxWrites.
	seedFull chan struct{}
	// nextSweep is when the loop next drops idle DEK entries; only the loop touches it.
	nextSweep time.Time
	// reported is the key id last passed to OnKeyIDChange as reported by the plugin;
	// only the loop (and New, before it) touches it.
	reported string

	mu      sync.Mutex
	changed chan struct{} // closed and replaced on every published view
	kick    chan struct{}
	cancel  context.CancelFunc
	done    chan struct{}
	closed  sync.Once
}

var _ transformers.KMSProvider = (*Provider)(nil)

// NewFactory returns the transformers.KMSFactory building Providers.
func NewFactory(o FactoryOptions) transformers.KMSFactory {
	if o.Metrics == nil {
		o.Metrics = NewMetrics(o.Registry)
	}
	return func(ctx context.Context, cfg *apiserver.KMSConfiguration, opts transformers.Options) (transformers.KMSProvider, error) {
		return New(cfg, opts, o)
	}
}

// New starts a provider: it returns at once, and a background loop calls Status and
// Encrypt until Close. Writes are possible once WaitReady returns; reads whose DEK source
// is not cached need only the plugin's Decrypt.
func New(cfg *apiserver.KMSConfiguration, topts transformers.Options, o FactoryOptions) (*Provider, error) {
	if cfg == nil || cfg.Name == "" {
		return nil, errors.New("kms v2: the provider has no name")
	}
	if o.Metrics == nil {
		o.Metrics = NewMetrics(o.Registry)
	}
	if o.DEKCacheEntries <= 0 {
		o.DEKCacheEntries = DefaultDEKCacheEntries
	}
	if o.AEADCacheEntries <= 0 {
		o.AEADCacheEntries = DefaultAEADCacheEntries
	}
	if o.HealthyTTL <= 0 {
		o.HealthyTTL = DefaultHealthyTTL
	}
	if o.UnhealthyTTL <= 0 {
		o.UnhealthyTTL = DefaultUnhealthyTTL
	}
	if o.WritesPerGeneration == 0 {
		o.WritesPerGeneration = maxWritesPerGeneration
	}
	if o.FenceRecheckInterval <= 0 {
		o.FenceRecheckInterval = DefaultFenceRecheckInterval
	}
	if o.SeedMaxAge == 0 {
		o.SeedMaxAge = DefaultSeedMaxAge
	}
	if o.SeedMaxWrites == 0 {
		o.SeedMaxWrites = DefaultSeedMaxWrites
	}
	if o.DEKCacheIdle == 0 {
		o.DEKCacheIdle = DefaultDEKCacheIdle
	}
	if o.KeyIDConfirmations <= 0 {
		o.KeyIDConfirmations = DefaultKeyIDConfirmations
	}
	// The process's own mode too: under GODEBUG=fips140=only Go refuses the counter's
	// cipher.NewGCM whatever the caller passed, and a Set built with Options{} (a test, a
	// tool) must not fail its first write there.
	if topts.FIPS != transformers.FIPSOff || fips140.Enabled() {
		o.RandomNonces = true
	}
	clk := topts.Clock
	if clk == nil {
		clk = clock.RealClock{}
	}
	log := topts.Logger
	if log.GetSink() == nil {
		log = klog.Background()
	}
	timeout := config.KMSTimeout(cfg)
	pm := o.Metrics.forProvider(cfg.Name)
	c, err := client.New(cfg.Endpoint, timeout, pm)
	if err != nil {
		return nil, fmt.Errorf("kms v2 provider %q: %w", cfg.Name, err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	p := &Provider{
		name: cfg.Name, endpoint: cfg.Endpoint,
		prefix: []byte(transformers.KeyPrefix(transformers.KMSv2Prefix, cfg.Name)),
		opts:   o, clock: clk, log: log.WithValues("kmsProvider", cfg.Name), apiID: topts.APIServerID,
		client: c, pm: pm,
		dek:      newDEKCache(o.DEKCacheEntries, pm),
		aeads:    newAEADCache(o.AEADCacheEntries),
		changed:  make(chan struct{}),
		kick:     make(chan struct{}, 1),
		seedFull: make(chan struct{}, 1),
		cancel:   cancel,
		done:     make(chan struct{}),
	}
	m := state.New(state.Config{
		Provider: cfg.Name, WriteType: wire.SourceHKDFSeed,
		StatusInterval: o.StatusInterval, RetryInterval: o.RetryInterval, WriteTTL: o.WriteTTL,
		Fenced: o.MayWriteKeyID != nil, FirstSeedHold: o.FirstSeedHold,
		SeedMaxAge: max(o.SeedMaxAge, 0), SeedMaxWrites: uint64(max(o.SeedMaxWrites, 0)),
		KeyIDConfirmations: o.KeyIDConfirmations,
	}, clk.Now())
	p.coarseNow.Store(clk.Now().UnixNano())
	o.Metrics.opened(cfg.Name)
	p.publish(m.View())
	go p.run(ctx, m)
	return p, nil
}

// Name is the provider name from the config.
func (p *Provider) Name() string { return p.name }

// Prefix is `k8s:enc:kms:v2:<name>:`.
func (p *Provider) Prefix() []byte { return p.prefix }

// errNotReady is returned by writes before the first DEK source exists.
func (p *Provider) errNotReady() error {
	v := p.view.Load()
	return p.refuseWrite(v, fmt.Sprintf("kms v2 provider %q cannot write yet: no DEK seed has been accepted from the plugin at %s (last problem: %v); check that the plugin is running and healthy", p.name, p.endpoint, v.Err))
}

// refuseWrite is the error of a write the plugin's state refuses (no DEK seed yet, the
// write window expired): a 503 the client is told to retry (transformers.
// WriteRefusedError, Retry-After when the provider next asks the plugin, at least a
// second) that storage migration still treats as "the plugin cannot serve now"
// (transformers.ErrKMSUnavailable).
func (p *Provider) refuseWrite(v *state.View, reason string) error {
	retry := time.Second
	if d := v.NextWake.Sub(p.clock.Now()); d > retry {
		retry = d
	}
	return transformers.Unavailable(&transformers.WriteRefusedError{Reason: reason, RetryAfter: retry})
}

// WriteKeyIDHash is "sha256:<hex>" of the key id new values are written under, ""
// before the first DEK seed (transformers.WriteKeyIDHasher: the write counter's key).
func (p *Provider) WriteKeyIDHash() string {
	if ws := p.write.Load(); ws != nil {
		return ws.keyIDHash
	}
	return ""
}

// Seal encrypts plaintext for dataCtx (the etcd key) and returns the full stored value.
func (p *Provider) Seal(_ context.Context, plaintext []byte, dataCtx value.Context) ([]byte, error) {
	ws := p.write.Load()
	if ws == nil {
		if v := p.view.Load(); v.Reused != "" {
			return nil, p.refusedReuse(v)
		}
		return nil, p.errNotReady()
	}
	if v := p.view.Load(); v.FirstSeedHeld {
		// A refusal the client sees as 503 (WriteRefusedError) that migration still
		// treats as "the plugin cannot serve now, retry" (ErrKMSUnavailable).
		return nil, transformers.Unavailable(&transformers.WriteRefusedError{Reason: fmt.Sprintf(
			"kms v2 provider %q holds writes under key id hash %q until every apiserver's KMS plugin reports it (at the latest until %s)",
			p.name, state.KeyIDHash(ws.keyID), v.FirstSeedHeldUntil.UTC().Format(time.RFC3339))})
	}
	now := p.clock.Now()
	if exp := ws.expiry.Load(); now.UnixNano() >= exp {
		return nil, p.refuseWrite(p.view.Load(), fmt.Sprintf("encryptedDEKSource with keyID hash %q expired at %s (current time is %s): the KMS plugin of provider %q at %s has not reported healthy since; fix the plugin",
			state.KeyIDHash(ws.keyID), time.Unix(0, exp).UTC().Format(time.RFC3339), now.UTC().Format(time.RFC3339), p.name, p.endpoint))
	}
	return ws.seal(p.prefix, plaintext, dataCtx.AuthenticatedData())
}

// Open decrypts a stored value (the bytes after Prefix()). Malformed values fail before
// any plugin call. stale is true when the value's key id or DEK source type differs
// from what is written now.
func (p *Provider) Open(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	var inline [wire.MaxInlineAnnotations]wire.Annotation
	var o wire.Object
	annos, err := wire.Decode(data, &o, inline[:])
	if err != nil {
		return nil, false, err
	}
	ws := p.write.Load()
	var e *dekEntry
	stale := false
	// A probe of the plugin (transformers.UncachedKMS) has it decrypt the DEK source
	// whatever is cached, and caches nothing, not even the derived AEAD.
	uncached := transformers.IsUncachedKMS(dataCtx)
	if !uncached && ws != nil && o.Tail != nil && string(o.Tail) == string(ws.tail) {
		e = ws.entry
		p.pm.hits.Inc()
	} else {
		if ws != nil {
			stale = string(o.KeyID) != ws.keyID || o.SourceType != ws.typ
		}
		if uncached {
			if e, err = p.unwrap(ctx, &o, annos); err != nil {
				return nil, false, err
			}
		} else {
			if e = p.recentEntry(o.Tail); e != nil {
				p.pm.hits.Inc()
			} else {
				k := wire.ComputeCacheKey(o.SourceType, o.DEKSource, o.KeyID, annos)
				if e = p.dek.get(k); e != nil {
					p.pm.hits.Inc()
				} else {
					p.pm.miss()
					if e, err = p.fetch(ctx, &o, annos, k); err != nil {
						return nil, false, err
					}
				}
				p.rememberTail(o.Tail, e)
			}
			e.touch(p.coarseNow.Load())
		}
	}
	out, err := p.decrypt(e, o.Data, dataCtx.AuthenticatedData(), ws, !uncached)
	if err != nil {
		return nil, false, err
	}
	return out, stale, nil
}

// recentTails bounds Provider.recent; a full map starts over (entries stay in the DEK
// cache, so the price of a reset is one SHA-256 per distinct DEK source).
const recentTails = 64

// recentEntry returns the DEK entry of a value whose identity fields are tail. The tail
// determines every identity field (the decoder takes them from these bytes alone), so
// equal tails mean the same DEK source.
func (p *Provider) recentEntry(tail []byte) *dekEntry {
	if tail == nil {
		return nil
	}
	if m := p.recent.Load(); m != nil {
		return (*m)[string(tail)]
	}
	return nil
}

func (p *Provider) rememberTail(tail []byte, e *dekEntry) {
	if tail == nil {
		return
	}
	p.recentMu.Lock()
	defer p.recentMu.Unlock()
	old := p.recent.Load()
	next := make(map[string]*dekEntry, recentTails)
	if old != nil && len(*old) < recentTails {
		for k, v := range *old {
			next[k] = v
		}
	}
	next[string(tail)] = e
	p.recent.Store(&next)
}

// decrypt opens data with e's key; cacheAEAD keeps an AEAD derived from a seed for the
// next value under it (false for an entry no later read will find).
func (p *Provider) decrypt(e *dekEntry, data, aad []byte, ws *writeState, cacheAEAD bool) ([]byte, error) {
	var a = e.aead
	if e.typ == wire.SourceHKDFSeed {
		if len(data) < infoSize+nonceSize+tagSize {
			return nil, fmt.Errorf("kms v2: the stored data was shorter than the required size (%d bytes, want at least %d); the value is truncated", len(data), infoSize+nonceSize+tagSize)
		}
		info := data[:infoSize]
		data = data[infoSize:]
		if ws != nil && ws.entry == e {
			if g := ws.gen.Load(); string(g.info[:]) == string(info) {
				a = g.aead
			}
		}
		if a == nil {
			k := aeadKey{e: e, info: [infoSize]byte(info)}
			if a = p.aeads.get(k); a == nil {
				var err error
				if a, err = deriveGCM(e.seed, info, p.opts.RandomNonces); err != nil {
					return nil, err
				}
				if cacheAEAD {
					p.aeads.put(k, a)
				}
			}
		}
	}
	if len(data) < nonceSize+tagSize {
		return nil, fmt.Errorf("kms v2: the stored data was shorter than the required size (%d bytes); the value is truncated", len(data))
	}
	var out []byte
	var err error
	if a.NonceSize() == 0 { // a random-nonce AEAD reads the nonce from the front itself
		out, err = a.Open(nil, nil, data, aad)
	} else {
		out, err = a.Open(nil, data[:nonceSize], data[nonceSize:], aad)
	}
	if err != nil {
		return nil, fmt.Errorf("kms v2: %w: the value was modified, truncated, or moved from another etcd key", err)
	}
	return out, nil
}

// fetch asks the plugin to decrypt a DEK source and caches it.
func (p *Provider) fetch(ctx context.Context, o *wire.Object, annotations []wire.Annotation, k wire.CacheKey) (*dekEntry, error) {
	e, err := p.unwrap(ctx, o, annotations)
	if err != nil {
		return nil, err
	}
	return p.dek.put(k, e), nil
}

// unwrap asks the plugin to decrypt a DEK source.
func (p *Provider) unwrap(ctx context.Context, o *wire.Object, annotations []wire.Annotation) (*dekEntry, error) {
	var annos map[string][]byte
	if len(annotations) > 0 {
		annos = make(map[string][]byte, len(annotations))
		for _, a := range annotations {
			annos[string(a.Key)] = a.Value
		}
	}
	if err := p.readUnavailable(); err != nil {
		return nil, err
	}
	uid := uuid.NewString()
	pt, err := p.client.Decrypt(ctx, uid, string(o.KeyID), o.DEKSource, annos, p.readCallOptions()...)
	p.noteRead(err)
	if err != nil {
		return nil, p.decryptFailed(err, state.KeyIDHash(string(o.KeyID)), uid)
	}
	e, err := newDEKEntry(o.SourceType, pt, p.opts.RandomNonces)
	if err != nil {
		return nil, fmt.Errorf("kms v2 provider %q: %w", p.name, err)
	}
	return e, nil
}

// Status describes the provider without key material.
func (p *Provider) Status() transformers.KMSStatus {
	v := p.view.Load()
	st := transformers.KMSStatus{Name: p.name, Endpoint: p.endpoint, Healthy: v.Healthy, LastStatus: v.LastStatus}
	if v.Err != nil {
		st.LastError = errtext.Bounded(v.Err, errtext.MaxPublished) // a plugin's error text is published
	}
	if v.Write != nil {
		st.KeyIDHash = state.KeyIDHash(v.Write.KeyID)
		st.DEKSourceType = v.Write.Type.String()
		st.WriteExpiry = v.Write.Expiry
	}
	if o := p.down.Load(); o != nil {
		st.UnavailableSince = o.since
	}
	st.ReportedKeyIDHash = state.KeyIDHash(v.Reported)
	if v.Held != "" {
		st.HeldKeyIDHash, st.HeldSince = state.KeyIDHash(v.Held), v.HeldSince
	}
	if v.FirstSeedHeld {
		st.FirstSeedHeldUntil = v.FirstSeedHeldUntil
	}
	keyIDStatus(&st, v)
	return st
}

// Check reports health for /healthz; it is the only cache in front of the plugin
// (pkg/healthz keeps none). A result younger than 20 s (healthy) or 3 s (unhealthy),
// from the loop's own Status or an earlier Check, is served from cache; otherwise it
// asks the loop for a fresh Status and waits for it or ctx, and concurrent callers wait
// for the same Status. It never holds a lock across an RPC.
func (p *Provider) Check(ctx context.Context) error {
	var requestedAt time.Time
	for requested := false; ; {
		p.mu.Lock()
		v, ch := p.view.Load(), p.changed
		p.mu.Unlock()
		if p.fresh(v) || requested && !v.HealthAt.Before(requestedAt) {
			return v.Err // from cache, or the answer to our request (or a newer one)
		}
		if !requested {
			requested, requestedAt = true, p.clock.Now()
			select {
			case p.kick <- struct{}{}:
			default:
			}
		}
		select {
		case <-ch:
		case <-p.done:
			return fmt.Errorf("kms v2 provider %q is closed", p.name)
		case <-ctx.Done():
			if v.Err != nil {
				return v.Err
			}
			return fmt.Errorf("kms v2 provider %q: health check timed out waiting for a Status: %w", p.name, ctx.Err())
		}
	}
}

// fresh reports whether Check may serve v's health from cache.
func (p *Provider) fresh(v *state.View) bool {
	ttl := p.opts.UnhealthyTTL
	if v.Healthy {
		ttl = p.opts.HealthyTTL
	}
	return !v.HealthAt.IsZero() && p.clock.Since(v.HealthAt) < ttl
}

// WaitReady returns when writes are possible, or ctx's error with the last problem.
func (p *Provider) WaitReady(ctx context.Context) error {
	for {
		p.mu.Lock()
		v, ch := p.view.Load(), p.changed
		p.mu.Unlock()
		select {
		case <-p.done:
			return fmt.Errorf("kms v2 provider %q is closed", p.name)
		default:
		}
		if v.CanWrite && p.write.Load() != nil {
			return nil
		}
		select {
		case <-ch:
		case <-p.done:
			return fmt.Errorf("kms v2 provider %q is closed", p.name)
		case <-ctx.Done():
			return fmt.Errorf("kms v2 provider %q is not ready to write (%v): %w", p.name, v.Err, ctx.Err())
		}
	}
}

// Close stops the loop and closes the plugin connection. Safe to call more than once.
func (p *Provider) Close() {
	p.closed.Do(func() {
		p.cancel()
		<-p.done
		_ = p.client.Close()
		p.opts.Metrics.closed(p.name) // after the loop ended: nothing sets the series again
	})
}

// publish makes a view visible to the data path and wakes waiters.
func (p *Provider) publish(v state.View) {
	if w := v.Write; w != nil {
		cur := p.write.Load()
		if cur == nil || cur.spec.Generation != w.Generation {
			ws, err := newWriteState(w, p.opts.WritesPerGeneration, uint64(max(p.opts.SeedMaxWrites, 0)), p.opts.RandomNonces, p.signalSeedFull)
			if err != nil {
				p.log.Error(err, "Cannot use the new DEK seed; keeping the previous one")
			} else {
				ws.entry.touch(p.coarseNow.Load())
				p.dek.put(ws.cacheKey, ws.entry)
				if cur != nil {
					// Its idle time starts now: reads of what it wrote went through the
					// write state, not the cache, and never stamped it.
					cur.entry.touch(p.coarseNow.Load())
				}
				p.write.Store(ws)
				p.opts.Metrics.newSeed(p.name, w)
				if p.opts.OnKeyIDChange != nil && (cur == nil || cur.spec.KeyID != w.KeyID) {
					defer p.opts.OnKeyIDChange(p.name, state.KeyIDHash(w.KeyID))
				}
				p.opts.Metrics.rotations.WithLabelValues(p.name).Inc()
				p.log.V(2).Info("New DEK seed for writes", "keyIDHash", state.KeyIDHash(w.KeyID), "generation", w.Generation, "refresh", w.Refresh)
			}
		} else {
			cur.expiry.Store(w.Expiry.UnixNano())
		}
		p.opts.Metrics.writeExpiry.WithLabelValues(p.name).Set(float64(w.Expiry.Unix()))
		if ws := p.write.Load(); ws != nil {
			p.opts.Metrics.seedWrites.WithLabelValues(p.name).Set(float64(ws.writes.Load()))
		}
	}
	if v.Reported != p.reported {
		p.reported = v.Reported
		if v.Held != "" && p.opts.OnKeyIDChange != nil {
			// Held: the others must learn that this plugin can read it (the fence of
			// every apiserver waits for that).
			defer p.opts.OnKeyIDChange(p.name, state.KeyIDHash(v.Reported))
		}
		if v.Held != "" {
			p.log.Info("The KMS plugin reports a new key id; writing with the previous one until every apiserver's plugin reports it",
				"keyIDHash", state.KeyIDHash(v.Held))
		}
	}
	if prev := p.view.Load(); prev != nil && prev.FirstSeedHeld && !v.FirstSeedHeld && v.FirstSeedHoldExpired && v.Write != nil {
		p.log.Error(nil, "Writing under a key id that not every apiserver's KMS plugin reports: the first-seed hold expired; values written now are unreadable on the apiservers whose plugin lags until it catches up",
			"keyIDHash", state.KeyIDHash(v.Write.KeyID), "hold", p.opts.FirstSeedHold)
		p.opts.Metrics.firstSeedHoldExpired.WithLabelValues(p.name).Inc()
	}
	p.reportKeyID(p.view.Load(), &v)
	h := 0.0
	if v.Healthy {
		h = 1
	}
	p.opts.Metrics.healthy.WithLabelValues(p.name).Set(h)
	p.mu.Lock()
	p.view.Store(&v)
	close(p.changed)
	p.changed = make(chan struct{})
	p.mu.Unlock()
}

// signalSeedFull wakes the loop for a seed that reached SeedMaxWrites. It never blocks
// (a write calls it): one pending signal is enough, the loop reads the count itself.
func (p *Provider) signalSeedFull() {
	select {
	case p.seedFull <- struct{}{}:
	default:
	}
}

// sweepInterval is how often the loop looks for idle DEK entries: an entry leaves
// between DEKCacheIdle and an eighth more after its last use.
func (p *Provider) sweepInterval() time.Duration { return p.opts.DEKCacheIdle / 8 }

// sweepIdleDEKs drops every cached DEK source whose last read is DEKCacheIdle or more
// before now, with what refers to it (the derived keys, the recent tails), so its
// plaintext is no longer held. The write seed is never dropped. It runs on the loop.
func (p *Provider) sweepIdleDEKs(now time.Time) {
	if p.opts.DEKCacheIdle <= 0 || now.Before(p.nextSweep) {
		return
	}
	p.nextSweep = now.Add(p.sweepInterval())
	cutoff := now.Add(-p.opts.DEKCacheIdle).UnixNano()
	var current *dekEntry
	if ws := p.write.Load(); ws != nil {
		current = ws.entry
	}
	// Entries reach the derived keys and the recent tails through the cache, but a read
	// racing the sweep may put one back there: judge every holder by the same stamp.
	idle := func(e *dekEntry) bool { return e != current && e.lastUsed.Load() <= cutoff }
	dropped := p.dek.removeIf(func(_ wire.CacheKey, e *dekEntry) bool { return idle(e) })
	p.aeads.removeIf(func(k aeadKey, _ cipher.AEAD) bool { return idle(k.e) })
	p.recentMu.Lock()
	if old := p.recent.Load(); old != nil {
		next := make(map[string]*dekEntry, len(*old))
		for k, e := range *old {
			if !idle(e) {
				next[k] = e
			}
		}
		p.recent.Store(&next)
	}
	p.recentMu.Unlock()
	if dropped == 0 {
		return
	}
	p.opts.Metrics.dekIdleExpired.WithLabelValues(p.name).Add(float64(dropped))
	p.log.V(2).Info("Dropped idle DEK sources from the cache", "count", dropped, "idle", p.opts.DEKCacheIdle)
}
