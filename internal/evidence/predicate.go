// Package evidence is what `rekey evidence` signs and `rekey evidence verify` checks: a
// rekey predicate (what etcd holds per resource and key, at one revision, with every
// apiserver's configuration hash and the FIPS mode) in an in-toto v1 Statement, in a
// DSSE envelope signed with an operator's ed25519 or ECDSA P-256 key.
//
// Nothing here reads etcd: cmd/rekey takes the inventory and the member records and
// hands them to Build; Sign and Verify work on bytes. It holds names, counts, check
// values and "sha256:" key id hashes, never key material.
package evidence

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/encryptionstate"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// PredicateType is the in-toto predicate type of rekey's evidence.
const PredicateType = "https://rekey.io/evidence/v1"

// Predicate is what etcd held at one revision, and who served it.
type Predicate struct {
	Cluster Cluster `json:"cluster"`
	// Revision is the etcd revision every resource was read at.
	Revision int64     `json:"revision"`
	TakenAt  time.Time `json:"takenAt"`
	// RekeyVersion is the build of the rekey that took the evidence.
	RekeyVersion string `json:"rekeyVersion"`
	// FIPS is the FIPS 140-3 mode of the process that took the evidence.
	FIPS bool `json:"fips"`
	// ConfigHash is the configuration the stored values were classified against
	// (--encryption-provider-config).
	ConfigHash string `json:"configHash"`
	// DecryptChecked is true when every value was also decrypted: Unreadable is exact.
	DecryptChecked bool `json:"decryptChecked"`
	// APIServers are the live apiservers' member records at the time of the evidence.
	APIServers []APIServer `json:"apiservers"`
	Resources  []Resource  `json:"resources"`
	Totals     Totals      `json:"totals"`
}

// Cluster names the cluster: its identity (<coordination prefix>/cluster), or none
// when no apiserver ever coordinated under the prefix.
type Cluster struct {
	// ID is the cluster identity's ClusterID, "" when there is none.
	ID                 string `json:"id"`
	EtcdPrefix         string `json:"etcdPrefix"`
	CoordinationPrefix string `json:"coordinationPrefix"`
}

// APIServer is one live apiserver's published state.
type APIServer struct {
	ID         string `json:"id"`
	Version    string `json:"version,omitempty"`
	ConfigHash string `json:"configHash"`
	// SameConfig is true when it runs the configuration the evidence classified with.
	SameConfig bool `json:"sameConfig"`
	// FIPS is the apiserver's published FIPS mode; nil when its record does not say.
	FIPS *bool `json:"fips,omitempty"`
}

// Resource is one resource's objects per key.
type Resource struct {
	Resource string `json:"resource"`
	// WriteKey is the fingerprint of the key the configuration writes it with.
	WriteKey     string `json:"writeKey"`
	Objects      int64  `json:"objects"`
	Plaintext    int64  `json:"plaintext"`
	Stale        int64  `json:"stale"`
	Unreadable   int64  `json:"unreadable"`
	Acknowledged int64  `json:"acknowledged,omitempty"`
	Keys         []Key  `json:"keys"`
}

// Key is how many objects of a resource one key holds.
type Key struct {
	// Fingerprint names the key without its material: "aesgcm/key1 check:<hex>",
	// "kms/vault sha256:<hex>" (the key id hash), "identity" for plaintext, and for a
	// key the configuration does not have, its provider and name as stored.
	Fingerprint string `json:"fingerprint"`
	Provider    string `json:"provider"`
	Name        string `json:"name,omitempty"`
	// Check is a local key's check value (transformers.CheckValue), KeyIDHash a KMS v2
	// value's key id hash.
	Check     string `json:"check,omitempty"`
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// InConfiguration is false for a key the configuration cannot read (a retired key).
	InConfiguration bool `json:"inConfiguration"`
	// For a key not in the configuration, what the key ledger recorded: the check value
	// of the one key of that name and prefix it knows ("" when it knows none, or several
	// secrets under the name, which the stored value cannot tell apart), and when it retired.
	LedgerCheck string     `json:"ledgerCheck,omitempty"`
	Retired     *time.Time `json:"retired,omitempty"`
	Current     bool       `json:"current"`
	Objects     int64      `json:"objects"`
	Unreadable  int64      `json:"unreadable,omitempty"`
}

// Totals add up Resources.
type Totals struct {
	Objects      int64 `json:"objects"`
	Plaintext    int64 `json:"plaintext"`
	Stale        int64 `json:"stale"`
	Unreadable   int64 `json:"unreadable"`
	Acknowledged int64 `json:"acknowledged"`
	// NotOnWriteKey counts objects not written with their resource's write key: the
	// stale (plaintext where a key writes among them) and the unreadable.
	NotOnWriteKey int64 `json:"notOnWriteKey"`
}

// Input is what Build turns into a Predicate.
type Input struct {
	Cluster      Cluster
	Revision     int64
	TakenAt      time.Time
	RekeyVersion string
	FIPS         bool
	Config       *config.Config
	Inventory    *migrate.Inventory
	// Members are the live apiservers (cluster.Snapshot.Members).
	Members []cluster.MemberState
	// Ledger is the cluster's key ledger (nil: none); it names keys the configuration
	// no longer has.
	Ledger *keyledger.Ledger
}

// Build makes the predicate of an inventory taken at in.Revision.
func Build(in Input) (*Predicate, error) {
	if in.Inventory == nil || in.Config == nil {
		return nil, fmt.Errorf("evidence: an inventory and the configuration it was taken with are needed")
	}
	p := &Predicate{
		Cluster: in.Cluster, Revision: in.Revision, TakenAt: in.TakenAt.UTC().Truncate(time.Second), RekeyVersion: in.RekeyVersion,
		FIPS: in.FIPS, ConfigHash: in.Config.Hash, DecryptChecked: in.Inventory.DecryptChecked,
		APIServers: []APIServer{}, Resources: []Resource{},
	}
	for _, m := range in.Members {
		p.APIServers = append(p.APIServers, APIServer{ID: m.APIServerID, Version: m.Version, ConfigHash: m.ConfigHash, SameConfig: m.ConfigHash == in.Config.Hash, FIPS: m.FIPS})
	}
	rules, _ := transformers.ByResource(transformers.Describe(in.Config))
	for _, ri := range in.Inventory.Resources {
		if ri.Revision != in.Revision && ri.Objects > 0 {
			return nil, fmt.Errorf("evidence: %s was read at revision %d, not %d", ri.Resource, ri.Revision, in.Revision)
		}
		keys, _ := transformers.Lookup(rules, schema.ParseGroupResource(ri.Resource))
		r := Resource{
			Resource: ri.Resource, Objects: ri.Objects, Plaintext: ri.Plaintext, Stale: ri.Stale,
			Unreadable: ri.Unreadable, Acknowledged: ri.Acknowledged, Keys: []Key{},
		}
		r.WriteKey = writeFingerprint(keys, ri)
		for _, b := range ri.Buckets {
			k := bucketKey(keys, b)
			if !k.InConfiguration {
				k.LedgerCheck, k.Retired = encryptionstate.FromLedger(in.Ledger, b)
			}
			k.Objects, k.Unreadable = b.Objects, b.Unreadable
			if !in.Inventory.DecryptChecked && !b.KnownKey {
				k.Unreadable = b.Objects
			}
			r.Keys = append(r.Keys, k)
		}
		slices.SortFunc(r.Keys, func(a, b Key) int { return strings.Compare(a.Fingerprint, b.Fingerprint) })
		p.Resources = append(p.Resources, r)
		p.Totals.Objects += r.Objects
		p.Totals.Plaintext += r.Plaintext
		p.Totals.Stale += r.Stale
		p.Totals.Unreadable += r.Unreadable
		p.Totals.Acknowledged += r.Acknowledged
		p.Totals.NotOnWriteKey += r.Stale + r.Unreadable
	}
	slices.SortFunc(p.Resources, func(a, b Resource) int { return strings.Compare(a.Resource, b.Resource) })
	return p, nil
}

// writeFingerprint names the key the configuration writes ri with.
func writeFingerprint(keys []transformers.ConfigKey, ri migrate.ResourceInventory) string {
	return fingerprint(encryptionstate.WriteKey(keys, ri))
}

// bucketKey names the key of a bucket (encryptionstate.BucketKey) as evidence prints it.
func bucketKey(keys []transformers.ConfigKey, b migrate.Count) Key {
	nk := encryptionstate.BucketKey(keys, b)
	fp := fingerprint(nk.KeyInfo)
	if !nk.InConfiguration {
		fp += " (not in configuration)"
	}
	return Key{Fingerprint: fp, Provider: nk.Provider, Name: nk.Key, Check: nk.Check, KeyIDHash: nk.KeyIDHash, InConfiguration: nk.InConfiguration, Current: nk.Current}
}

// fingerprint is "provider/name check:<hex>", "kms/name sha256:<hex>" or "identity".
func fingerprint(k transformers.KeyInfo) string {
	s := k.String()
	if k.Check != "" {
		s += " check:" + k.Check
	}
	return s
}

// Digest is the subject digest of a predicate: the sha256 of its canonical JSON
// encoding (encoding/json of the Go value: fields in declaration order, no spaces),
// which Verify recomputes from the signed statement.
func (p *Predicate) Digest() (string, error) {
	b, err := json.Marshal(p)
	if err != nil {
		return "", err
	}
	sum := sha256.Sum256(b)
	return hex.EncodeToString(sum[:]), nil
}

// NeedsAttention lists what an auditor should look at: plaintext (also where the rule
// writes identity),
// unreadable objects not acknowledged, objects not on the write key, apiservers on
// another configuration. Empty when the store is wholly on its write keys.
func (p *Predicate) NeedsAttention() []string {
	var out []string
	for _, r := range p.Resources {
		switch {
		case r.Plaintext > 0 && r.WriteKey == transformers.ProviderIdentity:
			out = append(out, fmt.Sprintf("%s: %d objects stored in plaintext (its rule writes identity)", r.Resource, r.Plaintext))
		case r.Plaintext > 0:
			out = append(out, fmt.Sprintf("%s: %d objects stored in plaintext", r.Resource, r.Plaintext))
		}
		if n := r.Unreadable - r.Acknowledged; n > 0 {
			out = append(out, fmt.Sprintf("%s: %d objects the configuration cannot read", r.Resource, n))
		}
		if r.Stale > 0 {
			out = append(out, fmt.Sprintf("%s: %d objects not on the write key %s", r.Resource, r.Stale, r.WriteKey))
		}
	}
	for _, a := range p.APIServers {
		if !a.SameConfig {
			out = append(out, fmt.Sprintf("apiserver %s runs configuration %s, not %s", a.ID, a.ConfigHash, p.ConfigHash))
		}
	}
	return out
}
