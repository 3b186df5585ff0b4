// Package encryptionstate is rekey's encryption-state API (rekey.io/v1alpha1
// EncryptionState): what etcd holds per resource and key, and what every apiserver
// runs, built from what the layer already has — the latest inventory
// (pkg/migrate), the member records and key write totals (pkg/cluster), the key
// ledger (pkg/keyledger) — and published by the migration leader alone.
//
// Build is pure. How the object is served differs per binary and is the binary's
// Publisher: the apiserver shim installs a read-only built-in group (NewREST), the
// distribution a CustomResourceDefinition it writes through its loopback client;
// RefuseWrites answers users' writes for both. docs/encryption-state.md says why.
//
// Nothing here holds key material: keys are named by provider, name, a local key's
// check value and a KMS v2 key id's "sha256:<hex>" hash.
package encryptionstate

import (
	"cmp"
	"fmt"
	"slices"
	"strings"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// AESGCMWriteBudget is how many values one aesgcm key may seal with random 96-bit
// nonces (NIST SP 800-38D, 8.3: 2^32 invocations).
const AESGCMWriteBudget = 1 << 32

// WriteBudget is how many values a key of provider may seal; 0 when rekey knows no
// bound (KMS v2 derives a key per seed and bounds it itself).
func WriteBudget(provider string) int64 {
	if provider == transformers.ProviderAESGCM {
		return AESGCMWriteBudget
	}
	return 0
}

// Input is what Build turns into a state: what the writer (this apiserver) has.
type Input struct {
	// ObservedBy is the writer's member id.
	ObservedBy string
	// Config is the writer's active configuration: the inventory classified against it.
	Config *config.Config
	FIPS   transformers.FIPSMode
	// Inventory is the latest inventory (nil: none yet; the state then has no resources).
	Inventory *migrate.Inventory
	// Members are the live apiservers (nil without coordination).
	Members []cluster.MemberState
	// Totals are the cluster's key write totals (nil without coordination).
	Totals []cluster.KeyTotal
	// Ledger is the key ledger (nil: unknown); it names retired keys.
	Ledger *keyledger.Ledger
}

// Build makes the status of the cluster's EncryptionState. Equal inputs give equal
// statuses: nothing in it depends on the time Build runs, so a publisher that finds
// the stored status equal writes nothing.
func Build(in Input) v1alpha1.EncryptionStateStatus {
	st := v1alpha1.EncryptionStateStatus{ObservedBy: in.ObservedBy, FIPS: fipsName(in.FIPS)}
	if in.Config != nil {
		st.ConfigHash = in.Config.Hash
	}
	for _, m := range in.Members {
		st.ClusterID = cmp.Or(st.ClusterID, m.ClusterID)
		a := v1alpha1.APIServerEncryptionState{ID: m.APIServerID, Version: m.Version, ConfigHash: m.ConfigHash, Agrees: m.ConfigHash == st.ConfigHash}
		if m.FIPS != nil {
			a.FIPS = fipsName(transformers.FIPSOff)
			if *m.FIPS {
				a.FIPS = fipsName(transformers.FIPSOn)
			}
		}
		st.APIServers = append(st.APIServers, a)
		if !a.Agrees {
			st.Attention = append(st.Attention, fmt.Sprintf("apiserver %s runs configuration %s, not %s", a.ID, a.ConfigHash, st.ConfigHash))
		}
	}
	if len(in.Members) == 0 {
		// Without coordination no apiserver publishes a record: the writer, which
		// knows its own, is the one listed.
		st.APIServers = append(st.APIServers, v1alpha1.APIServerEncryptionState{ID: in.ObservedBy, ConfigHash: st.ConfigHash, Agrees: true, FIPS: st.FIPS})
	}
	slices.SortFunc(st.APIServers, func(a, b v1alpha1.APIServerEncryptionState) int { return strings.Compare(a.ID, b.ID) })
	if in.Inventory == nil || in.Config == nil {
		return st
	}
	st.DecryptChecked = in.Inventory.DecryptChecked
	rules, _ := transformers.ByResource(transformers.Describe(in.Config))
	for _, ri := range in.Inventory.Resources {
		keys, _ := transformers.Lookup(rules, schema.ParseGroupResource(ri.Resource))
		r := resourceState(keys, ri, in)
		st.Resources = append(st.Resources, r)
		st.Totals.Objects += r.Objects
		st.Totals.Plaintext += r.Plaintext
		st.Totals.Stale += r.Stale
		st.Totals.Unreadable += r.Unreadable
		st.Totals.Acknowledged += r.Acknowledged
		st.Attention = append(st.Attention, attention(r)...)
	}
	slices.SortFunc(st.Resources, func(a, b v1alpha1.ResourceEncryptionState) int { return strings.Compare(a.Resource, b.Resource) })
	return st
}

// attention is what an operator should look at in one resource.
func attention(r v1alpha1.ResourceEncryptionState) []string {
	var out []string
	switch {
	case r.Plaintext > 0 && r.WriteKey.Provider == transformers.ProviderIdentity:
		out = append(out, fmt.Sprintf("%s: %d objects stored in plaintext (its rule writes identity)", r.Resource, r.Plaintext))
	case r.Plaintext > 0:
		out = append(out, fmt.Sprintf("%s: %d objects stored in plaintext", r.Resource, r.Plaintext))
	}
	if n := r.Unreadable - r.Acknowledged; n > 0 {
		out = append(out, fmt.Sprintf("%s: %d objects the configuration cannot read", r.Resource, n))
	}
	if r.Stale > 0 {
		out = append(out, fmt.Sprintf("%s: %d objects not on the write key", r.Resource, r.Stale))
	}
	return out
}

func resourceState(keys []transformers.ConfigKey, ri migrate.ResourceInventory, in Input) v1alpha1.ResourceEncryptionState {
	taken := in.Inventory.TakenAt
	r := v1alpha1.ResourceEncryptionState{
		Resource: ri.Resource, Revision: ri.Revision, InventoryTime: metav1.NewTime(taken.UTC().Truncate(time.Second)),
		WriteKey: keyRef(WriteKey(keys, ri)), Objects: ri.Objects, Plaintext: ri.Plaintext, Stale: ri.Stale,
		Unreadable: ri.Unreadable, Acknowledged: ri.Acknowledged,
	}
	for _, ck := range keys {
		r.ReadKeys = append(r.ReadKeys, keyRef(ck.Info()))
	}
	for _, b := range ri.Buckets {
		nk := BucketKey(keys, b)
		k := v1alpha1.StoredKey{Provider: nk.Provider, Name: nk.Key, Fingerprint: cmp.Or(nk.Check, nk.KeyIDHash),
			InConfiguration: nk.InConfiguration, Current: nk.Current, Objects: b.Objects, Unreadable: b.Unreadable, Acknowledged: b.Acknowledged}
		if !in.Inventory.DecryptChecked && !b.KnownKey {
			k.Unreadable = b.Objects
		}
		if !nk.InConfiguration {
			check, retired := FromLedger(in.Ledger, b)
			k.Fingerprint = cmp.Or(k.Fingerprint, check)
			if retired != nil {
				t := metav1.NewTime(*retired)
				k.Retired = &t
			}
		}
		use(&k, nk.KeyInfo, in, taken)
		r.Keys = append(r.Keys, k)
	}
	slices.SortFunc(r.Keys, func(a, b v1alpha1.StoredKey) int {
		return cmp.Or(strings.Compare(a.Provider, b.Provider), strings.Compare(a.Name, b.Name), strings.Compare(a.Fingerprint, b.Fingerprint))
	})
	return r
}

// use fills a key's first use, age and writes from the cluster's key write totals
// (the ledger's first use when the totals do not know the key).
func use(k *v1alpha1.StoredKey, ki transformers.KeyInfo, in Input, at time.Time) {
	if ki.Provider == transformers.ProviderIdentity || ki.Provider == "" {
		return
	}
	k.WriteBudget = WriteBudget(ki.Provider)
	var first time.Time
	for _, t := range in.Totals {
		if t.Provider == ki.Provider && t.Key.Key == ki.Key && t.Check == ki.Check && t.KeyIDHash == ki.KeyIDHash {
			first = t.FirstSeen
			k.Writes = int64(min(t.Writes, 1<<62))
		}
	}
	if first.IsZero() && in.Ledger != nil {
		for _, e := range in.Ledger.Of(ki) {
			if ki.Provider == transformers.ProviderKMSv2 && e.KeyIDHash != ki.KeyIDHash {
				continue // Of lists every key id of the provider
			}
			if !e.FirstUse.At.IsZero() && (first.IsZero() || e.FirstUse.At.Before(first)) {
				first = e.FirstUse.At
			}
		}
	}
	if first.IsZero() {
		return
	}
	f := metav1.NewTime(first.UTC().Truncate(time.Second))
	k.FirstUse = &f
	if age := at.Sub(first).Truncate(time.Minute); age >= 0 {
		k.Age = &metav1.Duration{Duration: age}
	}
}

func keyRef(k transformers.KeyInfo) v1alpha1.KeyRef {
	return v1alpha1.KeyRef{Provider: k.Provider, Name: k.Key, Fingerprint: cmp.Or(k.Check, k.KeyIDHash)}
}

func fipsName(m transformers.FIPSMode) string {
	switch m {
	case transformers.FIPSOn:
		return "on"
	case transformers.FIPSOnly:
		return "only"
	}
	return "off"
}

// NamedKey is the key of an inventory bucket, named without its material.
type NamedKey struct {
	transformers.KeyInfo
	// InConfiguration is false for a key the configuration cannot read (a retired key);
	// Current is true for the resource's write key.
	InConfiguration bool
	Current         bool
}

// WriteKey names the key the configuration writes ri with: its first entry, with the
// key id hash the inventory saw a KMS v2 writer use.
func WriteKey(keys []transformers.ConfigKey, ri migrate.ResourceInventory) transformers.KeyInfo {
	if len(keys) == 0 {
		return transformers.KeyInfo{Provider: transformers.ProviderIdentity}
	}
	k := keys[0].Info()
	if k.Provider == transformers.ProviderKMSv2 {
		k.KeyIDHash = ri.WriteKeyIDHash
	}
	return k
}

// BucketKey names the key of a bucket: a key of the configuration by its check value,
// a KMS v2 key by its key id hash, a key the configuration lacks by what is stored.
func BucketKey(keys []transformers.ConfigKey, b migrate.Count) NamedKey {
	k := transformers.KeyInfo{Provider: b.Provider, Key: b.Key, KeyIDHash: b.KeyIDHash}
	if b.KnownKey {
		for _, ck := range keys {
			if ck.Prefix == b.Prefix && ck.Provider == b.Provider {
				k.Check = ck.Info().Check
				break
			}
		}
	}
	return NamedKey{KeyInfo: k, InConfiguration: b.KnownKey, Current: !b.Stale && b.KnownKey}
}

// FromLedger is what the key ledger says of a key the configuration lacks: the check
// value when exactly one local key of that provider and name is recorded (a KMS v2
// bucket is already named by its key id hash), and its retirement.
func FromLedger(l *keyledger.Ledger, b migrate.Count) (check string, retired *time.Time) {
	if l == nil || b.Provider == transformers.ProviderKMSv2 {
		return "", nil
	}
	var found []keyledger.Entry
	for _, e := range l.Entries {
		if e.Provider == b.Provider && e.Name == b.Key && !e.IsHistory() {
			found = append(found, e)
		}
	}
	if len(found) != 1 {
		return "", nil
	}
	if r := found[0].Retired; r != nil {
		at := r.At.UTC()
		retired = &at
	}
	return found[0].Check, retired
}
