// Package transformers builds, from a validated EncryptionConfiguration, the per-resource
// transformer chains that encrypt data at rest, byte-for-byte compatible with
// kube-apiserver: the same prefixes, the same authenticated data (the etcd key), the same
// stale semantics (the first provider and its first key write; reading with any other
// one reports the value as stale).
//
// A Set is immutable once built. It knows nothing about files or reloads; pkg/reload
// swaps whole Sets.
package transformers

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv1"
)

// Options are the dependencies a Set is built with. Everything is passed in; nothing is
// global.
type Options struct {
	// Clock drives KMS v2 DEK expiry; defaults to the real clock.
	Clock clock.Clock
	// Logger defaults to klog's background logger.
	Logger klog.Logger
	// Metrics, when set, records upstream's apiserver_storage_transformation_* metrics.
	Metrics *Metrics
	// APIServerID is hashed into KMS metrics labels, as upstream does.
	APIServerID string
	// KMS builds KMS v2 providers. When nil, a config with a KMS provider fails to build
	// with a clear error.
	KMS KMSFactory
	// WriteCounts, when set, counts the values each key seals. Pass the same one to
	// every Build of a process so a reloaded key continues its count.
	WriteCounts *WriteCounts
	// FIPS is the process's FIPS 140-3 mode (the binary passes FIPSModeOf of
	// crypto/fips140): unless FIPSOff, Build refuses a configuration naming a provider
	// outside the approved set (FIPSRefusal) before building any provider.
	FIPS FIPSMode
}

// KMSFactory builds a KMS v2 provider for one `kms` entry of the configuration. The
// provider's loops run until Close; ctx only bounds the construction.
type KMSFactory func(ctx context.Context, cfg *apiserver.KMSConfiguration, opts Options) (KMSProvider, error)

// Sealer writes complete stored values and reads values whose prefix matched. Having
// the provider emit the prefix itself lets every write allocate exactly once.
type Sealer interface {
	// Prefix is the full stored prefix, e.g. "k8s:enc:aesgcm:v1:key1:".
	Prefix() []byte
	// Seal returns Prefix() ‖ ciphertext of plaintext bound to dataCtx.
	Seal(ctx context.Context, plaintext []byte, dataCtx value.Context) ([]byte, error)
	// Open decrypts ciphertext (the bytes after Prefix()). stale reports provider-level
	// staleness (for KMS v2: the value was written under another key id or DEK type).
	Open(ctx context.Context, ciphertext []byte, dataCtx value.Context) (plaintext []byte, stale bool, err error)
}

// KMSProvider is a KMS v2 envelope provider: a Sealer plus the plugin lifecycle.
type KMSProvider interface {
	Sealer
	// Name is the provider name from the config.
	Name() string
	// Check reports plugin health for /healthz; it may be served from a short cache.
	Check(ctx context.Context) error
	// WaitReady blocks until the provider can write (healthy Status and a write DEK)
	// or ctx ends.
	WaitReady(ctx context.Context) error
	// Status describes the provider for the status document. No key material.
	Status() KMSStatus
	// Close stops the provider's loops and closes its plugin connection.
	Close()
}

// Set is one built configuration: a transformer chain per configured resource rule.
type Set struct {
	hash  string
	rules map[schema.GroupResource]*Chain
	order []schema.GroupResource // rules in file order, for status output
	// fallback serves resources no rule names (NoRule): identity that refuses encrypted
	// data.
	fallback *Chain
	kms      []KMSProvider
	// kmsv1 are the KMS v1 readers, closed with the KMS v2 providers.
	kmsv1 []*kmsv1.Provider

	// shared holds the KMS providers for every Set derived from one Build (WithWriters):
	// they are closed when the last of those Sets is closed.
	shared    *sharedProviders
	closeOnce sync.Once
}

// sharedProviders counts the Sets using one Build's KMS providers.
type sharedProviders struct {
	mu   sync.Mutex
	refs int
}

// Build constructs a Set from a configuration that config.Load or config.Parse validated
// (so no KMS v1 provider writes). On error every provider already started is closed.
func Build(ctx context.Context, cfg *config.Config, opts Options) (set *Set, err error) {
	if cfg == nil || cfg.Encryption == nil {
		return nil, errors.New("transformers: no configuration to build from")
	}
	if err := FIPSRefusal(cfg, opts.FIPS); err != nil {
		return nil, err
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	s := &Set{hash: cfg.Hash, rules: map[schema.GroupResource]*Chain{}, shared: &sharedProviders{refs: 1}}
	defer func() {
		if err != nil {
			s.Close()
		}
	}()

	entries := make([]Entry[Sealer], 0, len(cfg.Encryption.Resources))
	for i, rc := range cfg.Encryption.Resources {
		var sealers []Sealer
		for j, p := range rc.Providers {
			built, err := s.buildProvider(ctx, p, opts)
			if err != nil {
				return nil, fmt.Errorf("resources[%d].providers[%d]: %w", i, j, err)
			}
			sealers = append(sealers, built...)
		}
		entries = append(entries, Entry[Sealer]{Resources: rc.Resources, Items: sealers})
	}
	byGR, order := ByResource(entries)
	s.order = order
	for gr, list := range byGR {
		s.rules[gr] = newChain(gr, config.GroupResourceString(gr), list, opts.Metrics, opts.WriteCounts)
	}
	s.fallback = newChain(schema.GroupResource{}, "", []Sealer{identitySealer{}}, nil, nil)
	return s, nil
}

func (s *Set) buildProvider(ctx context.Context, p apiserver.ProviderConfiguration, opts Options) ([]Sealer, error) {
	switch {
	case p.Identity != nil:
		return []Sealer{identitySealer{}}, nil
	case p.AESGCM != nil:
		return newAESGCMSealers(p.AESGCM.Keys)
	case p.AESCBC != nil:
		return newAESCBCSealers(p.AESCBC.Keys)
	case p.Secretbox != nil:
		return newSecretboxSealers(p.Secretbox.Keys)
	case p.KMS != nil && p.KMS.APIVersion == KMSv1APIVersion:
		v1, err := kmsv1.New(p.KMS)
		if err != nil {
			return nil, err
		}
		s.kmsv1 = append(s.kmsv1, v1)
		return []Sealer{kmsv1Sealer{Provider: v1, check: checkOf(KMSv1Fingerprint(p.KMS.Name, p.KMS.Endpoint))}}, nil
	case p.KMS != nil:
		if opts.KMS == nil {
			return nil, fmt.Errorf("kms provider %q: this Set was built without a KMS v2 factory (set transformers.Options.KMS, e.g. to kmsv2.NewFactory)", p.KMS.Name)
		}
		kp, err := opts.KMS(ctx, p.KMS, opts)
		if err != nil {
			return nil, fmt.Errorf("kms provider %q: %w", p.KMS.Name, err)
		}
		s.kms = append(s.kms, kp)
		return []Sealer{kp}, nil
	default:
		return nil, errors.New("provider does not contain any of the expected providers: KMS, AESGCM, AESCBC, Secretbox, Identity")
	}
}

// Hash is the content hash of the configuration the Set was built from.
func (s *Set) Hash() string { return s.hash }

// TransformerFor returns the chain for gr: the exact rule, else `<group>/*`, else `*.*`,
// else an identity transformer that refuses to read encrypted data. Never nil.
func (s *Set) TransformerFor(gr schema.GroupResource) *Chain {
	if c, ok := Lookup(s.rules, gr); ok {
		return c
	}
	return s.fallback
}

// KMSProviders lists the KMS v2 providers in file order.
func (s *Set) KMSProviders() []KMSProvider { return s.kms }

// Rules describes every configured resource rule in file order, for status output.
func (s *Set) Rules() []RuleInfo {
	out := make([]RuleInfo, 0, len(s.order))
	for _, gr := range s.order {
		out = append(out, s.rules[gr].Info())
	}
	return out
}

// Close stops every KMS provider's loops and connections once no other Set derived
// from the same Build (WithWriters) uses them. Safe to call more than once.
func (s *Set) Close() {
	s.closeOnce.Do(func() {
		s.shared.mu.Lock()
		s.shared.refs--
		last := s.shared.refs == 0
		s.shared.mu.Unlock()
		if !last {
			return
		}
		for _, k := range s.kms {
			k.Close()
		}
		for _, k := range s.kmsv1 {
			k.Close()
		}
	})
}

// Writer is a write fence's choice for one resource rule.
type Writer struct {
	// Index is the entry of the rule's chain (RuleInfo.ReadKeys) that writes.
	Index int
	// Refuse, when set, means no entry may write: every write of the rule fails with a
	// *WriteRefusedError (a ServiceUnavailable status) carrying this text (it names
	// what is missing), and reads are unchanged. A write fence refuses rather than write data that no other live
	// apiserver can read.
	Refuse string
	// RetryAfter, with Refuse, marks a refusal expected to end on its own (the fence is
	// waiting for the cluster, not for a configuration edit): the 503 carries it as
	// Retry-After. Zero: no Retry-After.
	RetryAfter time.Duration
}

// WithWriters returns a Set with the same providers whose rule for each resource named
// in writers (as RuleInfo.Resource spells it) writes with the entry at that index of
// its read chain (RuleInfo.ReadKeys) instead of the first, or refuses writes; rules not
// named, or named with index 0, write with the configuration's first entry. Reads are
// unchanged, and so is the stale flag: a value read by any entry but the
// configuration's first is stale, whichever entry writes. The new Set shares the KMS
// providers; each Set must be closed, and the providers stop with the last one. This
// is how a write fence holds a new write key back while it keeps the rest of a
// configuration.
func (s *Set) WithWriters(writers map[string]Writer) (*Set, error) {
	for res, w := range writers {
		c := s.ruleNamed(res)
		if c == nil {
			return nil, fmt.Errorf("transformers: no resource rule %q to choose a writer for", res)
		}
		if w.Index < 0 || w.Index >= len(c.sealers) {
			return nil, fmt.Errorf("transformers: resource rule %q has %d providers and keys; writer %d does not exist", res, len(c.sealers), w.Index)
		}
	}
	s.shared.mu.Lock()
	if s.shared.refs == 0 {
		s.shared.mu.Unlock()
		return nil, errors.New("transformers: the Set is closed; build a new one")
	}
	s.shared.refs++
	s.shared.mu.Unlock()
	d := &Set{hash: s.hash, rules: make(map[schema.GroupResource]*Chain, len(s.rules)), order: s.order,
		fallback: s.fallback, kms: s.kms, kmsv1: s.kmsv1, shared: s.shared}
	for gr, c := range s.rules {
		d.rules[gr] = c.withWriter(writers[c.resource])
	}
	return d, nil
}

func (s *Set) ruleNamed(resource string) *Chain {
	for _, c := range s.rules {
		if c.resource == resource {
			return c
		}
	}
	return nil
}

// RuleInfo describes one resource rule. It carries names and hashes, never keys.
type RuleInfo struct {
	// Resource is the rule as written in the config (`secrets`, `*.apps`, `*.*`).
	Resource string `json:"resource"`
	// WriteProvider is the provider type that writes: identity, aesgcm, aescbc,
	// secretbox or kms (never kmsv1: KMS v1 is only read).
	WriteProvider string `json:"writeProvider"`
	// WriteKey is the key name (aes*, secretbox) or the KMS provider name.
	WriteKey string `json:"writeKey,omitempty"`
	// WritePrefix is the stored prefix of new values.
	WritePrefix string `json:"writePrefix"`
	// ReadPrefixes lists, in order, every prefix this rule can read.
	ReadPrefixes []string `json:"readPrefixes"`
	// KMS is set when a KMS v2 provider writes.
	KMS *KMSStatus `json:"kms,omitempty"`
	// ReadKeys describes, in configuration order, every entry of the chain: the same
	// entries as ReadPrefixes, with KMS key id hashes. ReadKeys[0] is the entry the
	// configuration makes the writer.
	ReadKeys []KeyInfo `json:"readKeys"`
	// WriteIndex is the index in ReadKeys of the entry that writes: 0 unless a write
	// fence holds the configuration's first entry back (Set.WithWriters); NoWriter
	// while it refuses writes.
	WriteIndex int `json:"writeIndex,omitempty"`
	// WriteRefused is why writes are refused (WriteIndex is NoWriter), "" otherwise.
	WriteRefused string `json:"writeRefused,omitempty"`
}

// NoRule describes how a resource that no rule names is stored, as kube-apiserver
// stores it: written and read as plaintext, by identity alone (a Set's fallback chain).
// Whatever describes a configuration's rules (a Set, a member record, a migration's
// source, an etcd snapshot's check) answers with it when Lookup finds no rule.
func NoRule(resource string) RuleInfo {
	return RuleInfo{Resource: resource, WriteProvider: ProviderIdentity, ReadPrefixes: []string{""}, ReadKeys: []KeyInfo{{Provider: ProviderIdentity}}}
}

// NoWriter is RuleInfo.WriteIndex of a rule whose writes a write fence refuses.
const NoWriter = -1

// Writer returns the entry that writes, ok false while writes are refused.
func (r RuleInfo) Writer() (k KeyInfo, ok bool) {
	if r.WriteIndex < 0 || r.WriteIndex >= len(r.ReadKeys) {
		return KeyInfo{}, false
	}
	return r.ReadKeys[r.WriteIndex], true
}

// KeyInfo names one entry of a chain: a provider and key, never key material.
type KeyInfo struct {
	// Provider is identity, aesgcm, aescbc, secretbox, kms or kmsv1.
	Provider string `json:"provider"`
	// Key is the key name (aes*, secretbox) or the KMS provider name.
	Key string `json:"key,omitempty"`
	// Check is a local key's check value (CheckValue): equal secrets have equal check
	// values, so two apiservers can tell whether a key of the same name is the same
	// key. For kmsv1 it is the check value of its endpoint (KMSv1Fingerprint): KMS v1
	// has no key id, so name and endpoint are all that identify its key. Empty for
	// identity and KMS v2, and in records of rekey versions before it.
	Check string `json:"check,omitempty"`
	// KeyIDHash is, for kms, "sha256:<hex>" of the key id the plugin reports now
	// (empty until its first healthy Status).
	KeyIDHash string `json:"keyIDHash,omitempty"`
}

// String is "aesgcm/key1", "kms/vault sha256:…", or "identity".
func (k KeyInfo) String() string {
	s := k.Provider
	if k.Key != "" {
		s += "/" + k.Key
	}
	if k.KeyIDHash != "" {
		s += " " + k.KeyIDHash
	}
	return s
}

// SameEntry reports whether k and o name the same provider entry (for kms: the same
// provider name, whatever key id its plugin reports), whatever their secrets. Within
// one chain that is enough; across apiservers or configurations use Match.
func (k KeyInfo) SameEntry(o KeyInfo) bool { return k.Provider == o.Provider && k.Key == o.Key }

// KeyMatch is how two keys, possibly of two apiservers, compare (KeyInfo.Match).
type KeyMatch int

const (
	// KeysDiffer: another provider or another name.
	KeysDiffer KeyMatch = iota
	// KeysSame: the same provider and name and, for a local key, the same check value:
	// the same secret. KMS entries are the same provider entry; whether a plugin can
	// decrypt a key id is the KMS state's business.
	KeysSame
	// KeysConflict: the same provider and name with different check values: two
	// secrets under one name. Neither can read what the other writes.
	KeysConflict
	// KeysUnverified: the same provider and name of a local key, and one of them has no
	// check value (published by an older rekey): nothing proves the secrets equal.
	KeysUnverified
)

// Match compares k and o as keys: provider, name and check value. This is the one
// comparison of keys across apiservers and configurations.
func (k KeyInfo) Match(o KeyInfo) KeyMatch {
	switch {
	case !k.SameEntry(o):
		return KeysDiffer
	case !hasCheck(k.Provider):
		return KeysSame
	case k.Check == "" || o.Check == "":
		return KeysUnverified
	case k.Check != o.Check:
		return KeysConflict
	}
	return KeysSame
}

// SameKey reports whether k and o are provably the same key (Match is KeysSame).
func (k KeyInfo) SameKey(o KeyInfo) bool { return k.Match(o) == KeysSame }

// hasCheck reports whether provider's keys are told apart by their check value: local
// keys (the secret is in the configuration) and KMS v1 (its endpoint; it has no key id).
func hasCheck(provider string) bool {
	return provider == ProviderAESGCM || provider == ProviderAESCBC || provider == ProviderSecretbox || provider == ProviderKMSv1
}

// kmsv1Sealer is a KMS v1 reader in a chain, with the check value of its identity.
type kmsv1Sealer struct {
	*kmsv1.Provider
	check string
}

func (k kmsv1Sealer) checkValue() string { return k.check }
