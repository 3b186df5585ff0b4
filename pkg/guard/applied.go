package guard

import (
	"context"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sort"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/internal/atomicfile"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// AppliedStateVersion is the format version of AppliedState.
const AppliedStateVersion = 1

// AppliedStatePrefix is where apiservers persisted their AppliedState before it moved
// under the coordination prefix (coordination.AppliedState): <AppliedStatePrefix><apiserver-id>.
// It is still read when the new key is absent (EtcdAppliedState.Fallback), so an
// upgrade keeps its start-up check. With the default coordination prefix (/rekey, for
// --etcd-prefix /registry) both are the same key.
const AppliedStatePrefix = coordination.LegacyAppliedStatePrefix

// maxKeyIDHashes bounds the KMS v2 key id hashes remembered per provider.
const maxKeyIDHashes = 16

// AppliedState is what the last applied encryption configuration could read, without
// any key material: per rule, the resources and, per provider in order, its type, key
// name, stored prefix and a fingerprint of the secret (transformers.KeyFingerprint: a one-way,
// domain-separated SHA-256 of a random 128–256-bit key, which proves two secrets equal
// and cannot be turned back into either); for KMS providers the plugin endpoint and the
// "sha256:" hashes of the key ids seen in storage.
//
// The key-in-use guard only ever compares the configuration being replaced with the
// next one, in memory. A configuration refused on reload stays on disk, and at the next
// restart there is no "current" configuration left to compare with: the process that
// held the dropped key is gone. Persisting this state, and checking the configuration
// on disk against it before serving (CheckStartup), closes that way around the guard.
type AppliedState struct {
	Version    int           `json:"version"`
	ConfigHash string        `json:"configHash"`
	Source     string        `json:"source,omitempty"`
	AppliedAt  time.Time     `json:"appliedAt"`
	Rules      []AppliedRule `json:"rules"`
}

// AppliedRule is one rule of an applied configuration.
type AppliedRule struct {
	// Resources as written in the configuration (`secrets`, `*.apps`, `*.*`).
	Resources []string `json:"resources"`
	// Keys are the rule's read paths in order; the first one writes.
	Keys []AppliedKey `json:"keys"`
}

// AppliedKey is one key (or identity, or KMS provider) of an applied rule.
type AppliedKey struct {
	// Provider is identity, aesgcm, aescbc, secretbox, kms (v2) or kmsv1.
	Provider string `json:"provider"`
	// Name is the key name or the KMS provider name.
	Name string `json:"name,omitempty"`
	// Prefix is the stored prefix of the values it writes ("" for identity).
	Prefix string `json:"prefix"`
	// Fingerprint is "sha256:<hex>" of transformers.KeyFingerprint (local keys only).
	Fingerprint string `json:"fingerprint,omitempty"`
	// Endpoint is the KMS plugin's endpoint.
	Endpoint string `json:"endpoint,omitempty"`
	// KeyIDHashes are the "sha256:<hex>" key ids the inventory saw under this KMS
	// provider (at most 16).
	KeyIDHashes []string `json:"keyIDHashes,omitempty"`
}

// NewAppliedState describes cfg. inv, when not nil, supplies the KMS v2 key id hashes
// seen in storage.
func NewAppliedState(cfg *config.Config, inv *migrate.Inventory, now time.Time) *AppliedState {
	s := &AppliedState{Version: AppliedStateVersion, AppliedAt: now.UTC(), Rules: appliedRules(cfg)}
	if cfg != nil {
		s.ConfigHash, s.Source = cfg.Hash, cfg.Source
	}
	if inv == nil {
		return s
	}
	seen := map[string]map[string]bool{}
	for _, ri := range inv.Resources {
		for _, b := range ri.Buckets {
			if b.Provider == transformers.ProviderKMSv2 && b.KeyIDHash != "" && b.Objects > 0 {
				if seen[b.Prefix] == nil {
					seen[b.Prefix] = map[string]bool{}
				}
				seen[b.Prefix][b.KeyIDHash] = true
			}
		}
	}
	for i := range s.Rules {
		for j := range s.Rules[i].Keys {
			k := &s.Rules[i].Keys[j]
			for h := range seen[k.Prefix] {
				k.KeyIDHashes = append(k.KeyIDHashes, h)
			}
			sort.Strings(k.KeyIDHashes)
			if len(k.KeyIDHashes) > maxKeyIDHashes {
				k.KeyIDHashes = k.KeyIDHashes[:maxKeyIDHashes]
			}
		}
	}
	return s
}

func appliedRules(cfg *config.Config) []AppliedRule {
	var out []AppliedRule
	for _, e := range transformers.Describe(cfg) {
		keys := make([]AppliedKey, len(e.Items))
		for i, k := range e.Items {
			keys[i] = AppliedKey{Provider: k.Provider, Name: k.Name, Prefix: k.Prefix, Endpoint: k.Endpoint}
			if k.Fingerprint != ([32]byte{}) {
				keys[i].Fingerprint = "sha256:" + hex.EncodeToString(k.Fingerprint[:])
			}
		}
		out = append(out, AppliedRule{Resources: e.Resources, Keys: keys})
	}
	return out
}

// chains is the guard's view of the state.
func (s *AppliedState) chains() chains {
	if s == nil {
		return chainsOf(nil)
	}
	return chainsOf(s.Rules)
}

// chainsOf turns rules into lookup chains; a fingerprint that does not decode matches
// no key, so a damaged state errs on the side of refusing.
func chainsOf(rules []AppliedRule) chains {
	entries := make([]transformers.Entry[chainEntry], 0, len(rules))
	for _, r := range rules {
		e := transformers.Entry[chainEntry]{Resources: r.Resources, Items: make([]chainEntry, 0, len(r.Keys))}
		for _, k := range r.Keys {
			ce := chainEntry{prefix: k.Prefix}
			ce.fp, _ = k.fingerprint()
			e.Items = append(e.Items, ce)
		}
		entries = append(entries, e)
	}
	byGR, order := transformers.ByResource(entries)
	cs := chains{byGR: make(map[schema.GroupResource]chain, len(byGR)), order: order}
	for gr, es := range byGR {
		cs.byGR[gr] = chain{entries: es}
	}
	return cs
}

// fingerprint is the entry's fingerprint as this version compares it, and false when
// the entry has none (identity, KMS v2). A fingerprint that does not decode is one no
// key has, so a damaged state errs on the side of refusing.
//
// A KMS v1 entry's fingerprint is recomputed from its Name and Endpoint with
// transformers.KMSv1Fingerprint, which hashes the socket the endpoint dials, not its
// spelling: states saved before that change hold the fingerprint of the endpoint as
// written (kmsv1SpellingFingerprint), and a configuration spelling the same socket
// otherwise (unix:/x for unix:///x) must still find its key. It is recomputed only when
// the stored fingerprint is provably of that name and endpoint (either way of
// computing it); without an endpoint, or with a fingerprint of something else, the
// stored one stays and is compared strictly.
func (k AppliedKey) fingerprint() ([32]byte, bool) {
	if k.Fingerprint == "" {
		return [32]byte{}, false
	}
	var fp [32]byte
	b, err := hex.DecodeString(trimHashPrefix(k.Fingerprint))
	if err != nil || len(b) != len(fp) {
		return [32]byte{0: 0xff, 31: 0xff}, true
	}
	copy(fp[:], b)
	if k.Provider == transformers.ProviderKMSv1 && k.Endpoint != "" {
		current := transformers.KMSv1Fingerprint(k.Name, k.Endpoint)
		if fp == current || fp == kmsv1SpellingFingerprint(k.Name, k.Endpoint) {
			return current, true
		}
	}
	return fp, true
}

// kmsv1SpellingFingerprint is transformers.KMSv1Fingerprint as rekey computed it before
// KMS v1 check values followed the socket (commit ba3140f): of the endpoint as written.
// It only recognises the fingerprints of applied states saved then; nothing computes
// new ones with it.
func kmsv1SpellingFingerprint(name, endpoint string) [32]byte {
	return transformers.KeyFingerprint(transformers.KMSv1Prefix, []byte(name+"\x00"+endpoint))
}

func trimHashPrefix(s string) string {
	const p = "sha256:"
	if len(s) > len(p) && s[:len(p)] == p {
		return s[len(p):]
	}
	return s
}

// CheckApplied lists what the configuration next cannot read that the persisted state
// applied could: the guard's rules (CheckChange) with applied in the place of the
// current configuration. inv must be nil or taken just now, with nothing written since
// (at start, before serving): its counts are then exact for every resource it covers.
func CheckApplied(inv *migrate.Inventory, applied *AppliedState, next *config.Config) []Violation {
	return checkChains(inv, applied.chains(), newChains(next), true)
}

// prefixes lists every stored prefix of the state.
// startupRules are the resources named by prev's rules (nil: none applied yet) and
// cfg's, each once.
func startupRules(prev *AppliedState, cfg *config.Config) []string {
	var out []string
	seen := map[string]bool{}
	add := func(rs []string) {
		for _, r := range rs {
			if !seen[r] {
				seen[r] = true
				out = append(out, r)
			}
		}
	}
	if prev != nil {
		for _, r := range prev.Rules {
			add(r.Resources)
		}
	}
	for _, e := range transformers.Describe(cfg) {
		add(e.Resources)
	}
	return out
}

func (s *AppliedState) prefixes() []string {
	var out []string
	for _, r := range s.Rules {
		for _, k := range r.Keys {
			if k.Prefix != "" {
				out = append(out, k.Prefix)
			}
		}
	}
	return out
}

// withPrefixes is a Source that also knows extra stored prefixes.
type withPrefixes struct {
	migrate.Source
	extra []string
}

func (w withPrefixes) KnownPrefixes() []string {
	return append(append([]string(nil), w.Source.KnownPrefixes()...), w.extra...)
}

// AppliedStateStore persists the AppliedState of one apiserver.
type AppliedStateStore interface {
	// Load returns the state, or nil and no error when none was saved yet.
	Load(ctx context.Context) (*AppliedState, error)
	Save(ctx context.Context, s *AppliedState) error
	// String names where the state lives, for messages.
	String() string
}

// EtcdAppliedState keeps the state in etcd at Key (coordination.AppliedState: under the
// coordination prefix, which lies outside the resource prefix, so no scan, migration or
// watch of stored objects ever sees it, and belongs to one cluster, so two clusters
// sharing an etcd do not read each other's states).
// This is the shim's choice: etcd is the one store every restart of the apiserver is
// guaranteed to see (a local file can be lost with a node or a container's ephemeral
// disk, and then the check silently passes), it already holds the data whose keys the
// state describes, and it is shared by every apiserver, which a cluster-wide state
// will need.
type EtcdAppliedState struct {
	Client *clientv3.Client
	Key    string
	// Fallback, when set, is read when Key holds no state: where an older version kept
	// it (AppliedStatePrefix + id). Save writes Key only.
	Fallback string
}

// Load reads the state at Key, else at Fallback.
func (e EtcdAppliedState) Load(ctx context.Context) (*AppliedState, error) {
	keys := []string{e.Key}
	if e.Fallback != "" && e.Fallback != e.Key {
		keys = append(keys, e.Fallback)
	}
	for _, key := range keys {
		resp, err := e.Client.Get(ctx, key)
		if err != nil {
			return nil, fmt.Errorf("reading the applied encryption state from etcd key %q: %w; the apiserver's etcd user needs read and write access to it (or keep the state in a file: --encryption-state-file)", key, err)
		}
		if len(resp.Kvs) == 1 {
			return decodeAppliedState(resp.Kvs[0].Value, "etcd key "+key)
		}
	}
	return nil, nil
}

// Save writes the state.
func (e EtcdAppliedState) Save(ctx context.Context, s *AppliedState) error {
	b, err := json.Marshal(s)
	if err != nil {
		return err
	}
	if _, err := e.Client.Put(ctx, e.Key, string(b)); err != nil {
		return fmt.Errorf("saving the applied encryption state to etcd key %q: %w; the apiserver's etcd user needs read and write access to it (or keep the state in a file: --encryption-state-file)", e.Key, err)
	}
	return nil
}

func (e EtcdAppliedState) String() string { return "etcd key " + e.Key }

// FileAppliedState keeps the state in a local file, for library users without a
// coordination store. The file must be on storage that survives restarts of the
// apiserver; it is replaced atomically and durably (atomicfile.WriteFile: a crash
// leaves the old state or the new one, and never undoes a save the start-up check
// already relies on), keeping the file's mode and owner.
type FileAppliedState struct{ Path string }

// Load reads the state.
func (f FileAppliedState) Load(context.Context) (*AppliedState, error) {
	b, err := os.ReadFile(f.Path)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading the applied encryption state: %w", err)
	}
	return decodeAppliedState(b, "file "+f.Path)
}

// Save writes the state; a new file is readable by its owner only.
func (f FileAppliedState) Save(_ context.Context, s *AppliedState) error {
	b, err := json.MarshalIndent(s, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(f.Path, b, 0o600); err != nil {
		return fmt.Errorf("saving the applied encryption state: %w", err)
	}
	return nil
}

func (f FileAppliedState) String() string { return "file " + f.Path }

func decodeAppliedState(b []byte, where string) (*AppliedState, error) {
	var s AppliedState
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("the applied encryption state in %s is not valid JSON (%v); delete it to skip the start-up check once", where, err)
	}
	if s.Version != AppliedStateVersion {
		return nil, fmt.Errorf("the applied encryption state in %s has version %d, this build reads %d; delete it to skip the start-up check once", where, s.Version, AppliedStateVersion)
	}
	return &s, nil
}

// StartupOptions configure CheckStartup.
type StartupOptions struct {
	// State is where the last applied configuration's state is kept. Required.
	State AppliedStateStore
	// Config is the configuration about to be served (the file on disk). Required.
	Config *config.Config
	// Client, Source and Resources, when all set, take an inventory (prefixes only, no
	// decryption) to count the objects under each dropped key.
	Client    *clientv3.Client
	Source    migrate.Source
	Resources []migrate.Resource
	// Resolve, when set, replaces Resources: it is given the resources (wildcards
	// included) of the last applied configuration's rules and of Config's, and returns
	// the stored resources they cover (migrate.Resolver.Resolve).
	Resolve func(ctx context.Context, rules []string) (migrate.Resolution, error)
	// Transformers, when given with a client, serve the configuration (the reload agent,
	// or FromSet's transformers of a built Set): one stored object per
	// KMS v2 key id of the start-up inventory is decrypted with it (CheckDecrypt), so
	// a provider that kept its name but moved to another keyring while the apiserver was
	// down is refused too. A plugin that does not answer yet is logged, not refused:
	// the apiserver starts with a KMS outage as kube-apiserver does.
	Transformers value.ResourceTransformers
	// Override lets the start go on despite violations (logged).
	Override bool
	// Retention, when its Retention is set, refuses a configuration on disk that drops
	// a key of the last applied one that an etcd snapshot within the backup retention
	// may need (Check Retention; Override lets it through too).
	Retention RetentionOptions
	// Inventory, when set, receives the start-up inventory.
	Inventory *migrate.InventoryStore
	Clock     clock.PassiveClock
	// Metrics receive the start-up inventory's figures; Refusals count a refusal.
	Metrics  *migrate.Metrics
	Refusals *Metrics
	Logger   klog.Logger
}

// CheckStartup checks, before an apiserver serves, that the configuration on disk can
// read everything the last applied configuration could (CheckApplied, with a fresh
// inventory when a client is given), and then records the configuration as applied.
// A refusal is a *RefusedError (Check Startup, or Decrypt) naming resource, key and
// count; nothing is saved then, so
// every restart refuses until the keys are restored or Override is set.
func CheckStartup(ctx context.Context, o StartupOptions) error {
	if o.State == nil || o.Config == nil {
		return errors.New("guard: the start-up check needs a state store and the configuration")
	}
	if o.Clock == nil {
		o.Clock = clock.RealClock{}
	}
	if o.Logger.GetSink() == nil {
		o.Logger = klog.Background()
	}
	prev, err := o.State.Load(ctx)
	if err != nil {
		return err
	}
	var inv *migrate.Inventory
	res := migrate.Resolution{Resources: o.Resources}
	if o.Resolve != nil {
		if res, err = o.Resolve(ctx, startupRules(prev, o.Config)); err != nil {
			// Without counts every dropped key is still reported (unknown count).
			o.Logger.Error(err, "Cannot list the stored resources the rules cover; checking the encryption configuration without object counts")
			res = migrate.Resolution{}
		}
	}
	if o.Client != nil && o.Source != nil && len(res.Resources) > 0 {
		src := o.Source
		if prev != nil {
			// Values are sorted into buckets by the prefixes the configuration knows, and
			// a key the configuration on disk dropped is exactly what must be matched to
			// the state's prefix (a guess stops at the first ':' of a key name).
			src = withPrefixes{Source: src, extra: prev.prefixes()}
		}
		inv, err = migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: o.Client, Source: src, Resources: res.Resources, Wildcards: res.Wildcards, ConfigHash: o.Config.Hash, Clock: o.Clock, Metrics: o.Metrics})
		if err != nil {
			// Without counts every dropped key is still reported (unknown count).
			o.Logger.Error(err, "Start-up inventory failed; checking the encryption configuration without object counts")
			inv = nil
		} else if o.Inventory != nil {
			o.Inventory.Set(inv)
		}
	}
	if prev != nil {
		if vs := CheckApplied(inv, prev, o.Config); len(vs) > 0 {
			gerr := &RefusedError{
				Check:      Startup,
				Next:       ConfigName(o.Config),
				Violations: vs,
				Applied:    fmt.Sprintf("%s (%s), applied at %s, as recorded in %s", prev.Source, prev.ConfigHash, prev.AppliedAt.Format(time.RFC3339), o.State),
			}
			if !o.Override {
				return o.Refusals.Count(gerr)
			}
			o.Logger.Info("Starting with an encryption configuration that drops keys still in use, because the override is set", "config", o.Config.Source, "hash", o.Config.Hash, "violations", len(vs), "detail", gerr.Error())
		}
		ro := o.Retention
		ro.Override, ro.Logger = func() bool { return o.Override }, o.Logger
		if ro.Clock == nil {
			ro.Clock = o.Clock
		}
		if err := ro.check(ctx, appliedKeys(prev), o.Config); err != nil {
			return o.Refusals.Count(err)
		}
	}
	if o.Transformers != nil && inv != nil {
		fs, err := CheckDecrypt(ctx, inv, o.Client, o.Config, o.Transformers)
		if err != nil {
			return err
		}
		var refused []DecryptFailure
		for _, f := range fs {
			if f.Unavailable {
				o.Logger.Info("KMS plugin unavailable at start; its stored data could not be test-decrypted", "detail", f.String())
				continue
			}
			refused = append(refused, f)
		}
		if len(refused) > 0 {
			derr := &RefusedError{Check: Decrypt, Next: ConfigName(o.Config), Failures: refused}
			if !o.Override {
				return o.Refusals.Count(derr)
			}
			o.Logger.Info("Starting with a kms plugin that cannot decrypt stored data, because the override is set", "config", o.Config.Source, "hash", o.Config.Hash, "detail", derr.Error())
		}
	}
	return o.State.Save(ctx, NewAppliedState(o.Config, inv, o.Clock.Now()))
}
