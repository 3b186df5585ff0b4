package keyledger

import (
	"sort"
	"time"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Version is the format version of Ledger.
const Version = 1

// ledgerPath is the ledger's key under the coordination prefix.
const ledgerPath = "/ledger"

// Key is where the ledger of the cluster under coordinationPrefix is kept.
func Key(coordinationPrefix string) string { return coordinationPrefix + ledgerPath }

// MaxEntries bounds the ledger. A cluster rotating weekly for years stays far below
// it; beyond it, the entries retired longest ago are forgotten first (their backups
// have long expired), then, should every entry still be in use, the least recently used.
const MaxEntries = 256

// DefaultTouchInterval is how often a member records again that it still writes with
// a key: often enough to place a snapshot within minutes, rarely enough that etcd sees
// a handful of writes per hour from the whole cluster.
const DefaultTouchInterval = 5 * time.Minute

// Event is when something happened: the member's clock (for people and for the
// retention, which is a duration) and the etcd revision the member had read the ledger
// at (for ordering between members: the event happened after that revision).
type Event struct {
	At       time.Time `json:"at"`
	Revision int64     `json:"revision"`
}

// Entry is one key the cluster wrote with. It holds names, check values and hashes,
// never key material.
type Entry struct {
	// Provider is aesgcm, aescbc, secretbox or kms (v2).
	Provider string `json:"provider"`
	// Name is the key name or the KMS provider name.
	Name string `json:"name"`
	// Check is a local key's check value (transformers.CheckValue).
	Check string `json:"check,omitempty"`
	// KeyIDHash is a KMS v2 key id's "sha256:<hex>".
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// Prefix is the stored prefix of its values.
	Prefix string `json:"prefix"`
	// FirstUse and LastUse are the first and last time a member was seen writing with
	// it (LastUse is refreshed at most every touch interval).
	FirstUse Event `json:"firstUse"`
	LastUse  Event `json:"lastUse"`
	// LastStored is the last time an inventory counted objects under it.
	LastStored *Event `json:"lastStored,omitempty"`
	// Retired is when it stopped being needed: nobody writes with it, and an inventory
	// taken after its last use found no object under it. Cleared if it is written or
	// found stored again.
	Retired *Event `json:"retired,omitempty"`
}

// Info is the entry as a chain entry names it.
func (e Entry) Info() transformers.KeyInfo {
	return transformers.KeyInfo{Provider: e.Provider, Key: e.Name, Check: e.Check, KeyIDHash: e.KeyIDHash}
}

// String is "aesgcm key1 (check a1b2…)" or "kms vault (key id sha256:…)".
func (e Entry) String() string {
	s := e.Provider + " " + e.Name
	switch {
	case e.KeyIDHash != "":
		s += " (key id " + e.KeyIDHash + ")"
	case e.Check != "":
		s += " (check " + e.Check + ")"
	}
	return s
}

// sameKey reports whether e records the key k: provider, name and check value, and for
// KMS v2 the key id hash.
func (e Entry) sameKey(k transformers.KeyInfo) bool {
	return e.Provider == k.Provider && e.Name == k.Key && e.Check == k.Check && e.KeyIDHash == k.KeyIDHash
}

// Ledger is every key the cluster wrote with.
type Ledger struct {
	Version int     `json:"version"`
	Entries []Entry `json:"entries"`
}

// Observation is what one member sees now.
type Observation struct {
	// Rules are the member's running rules (reload.Agent.Rules): their writers are the
	// keys it writes with.
	Rules []transformers.RuleInfo
	// Inventory is the member's latest inventory, or nil.
	Inventory *migrate.Inventory
}

// recorded reports whether a key is one the ledger keeps: values a backup cannot be
// read without. Plaintext needs no key, and a KMS v2 key is known by its key id only
// once its plugin reported one.
func recorded(k transformers.KeyInfo) bool {
	switch k.Provider {
	case transformers.ProviderAESGCM, transformers.ProviderAESCBC, transformers.ProviderSecretbox:
		return true
	case transformers.ProviderKMSv2:
		return k.KeyIDHash != ""
	}
	return false
}

// Observe folds what a member sees at now, having read the ledger at etcd revision
// rev, into l, and reports whether l changed (whether it must be written). It is
// idempotent: observing the same thing again within touch changes nothing, whichever
// member observes it.
func (l *Ledger) Observe(o Observation, now time.Time, rev int64, touch time.Duration) bool {
	if touch <= 0 {
		touch = DefaultTouchInterval
	}
	l.Version = Version
	ev := Event{At: now.UTC(), Revision: rev}
	changed := false
	writing := map[int]bool{}
	for _, r := range o.Rules {
		w, ok := r.Writer()
		if !ok || !recorded(w) {
			continue
		}
		i := l.find(w)
		if i < 0 {
			l.Entries = append(l.Entries, Entry{Provider: w.Provider, Name: w.Key, Check: w.Check, KeyIDHash: w.KeyIDHash,
				Prefix: r.ReadPrefixes[r.WriteIndex], FirstUse: ev, LastUse: ev})
			writing[len(l.Entries)-1] = true
			changed = true
			continue
		}
		e := &l.Entries[i]
		if writing[i] {
			continue
		}
		writing[i] = true
		if e.Retired != nil {
			e.Retired = nil
			changed = true
		}
		if now.Sub(e.LastUse.At) >= touch {
			e.LastUse = ev
			changed = true
		}
	}
	if o.Inventory != nil {
		for i := range l.Entries {
			if l.observeStored(i, o.Inventory, writing[i], ev, touch) {
				changed = true
			}
		}
	}
	if l.prune() {
		changed = true
	}
	return changed
}

// observeStored folds an inventory's counts of entry i into it.
func (l *Ledger) observeStored(i int, inv *migrate.Inventory, writing bool, ev Event, touch time.Duration) bool {
	e := &l.Entries[i]
	objects, oldest := stored(*e, inv)
	switch {
	case objects > 0:
		changed := false
		if e.Retired != nil {
			e.Retired = nil // found again (a restored backup): needed again
			changed = true
		}
		if e.LastStored == nil || ev.At.Sub(e.LastStored.At) >= touch {
			e.LastStored = &ev
			changed = true
		}
		return changed
	case writing || e.Retired != nil || oldest <= e.LastUse.Revision:
		// Written now, already retired, or the inventory may predate the last write.
		return false
	}
	e.Retired = &ev
	return true
}

// stored counts the objects inv found under e, and returns the oldest revision any
// of its resources was read at (0 when it covers none).
func stored(e Entry, inv *migrate.Inventory) (objects, oldest int64) {
	for _, ri := range inv.Resources {
		if oldest == 0 || ri.Revision < oldest {
			oldest = ri.Revision
		}
		for _, b := range ri.Buckets {
			if b.Prefix == e.Prefix && (e.KeyIDHash == "" || b.KeyIDHash == e.KeyIDHash) {
				objects += b.Objects
			}
		}
	}
	return objects, oldest
}

func (l *Ledger) find(k transformers.KeyInfo) int {
	for i, e := range l.Entries {
		if e.sameKey(k) {
			return i
		}
	}
	return -1
}

// prune keeps at most MaxEntries: it forgets the entries retired longest ago, then the
// least recently used.
func (l *Ledger) prune() bool {
	if len(l.Entries) <= MaxEntries {
		return false
	}
	order := make([]int, len(l.Entries))
	for i := range order {
		order[i] = i
	}
	// The first ones in this order are forgotten.
	sort.SliceStable(order, func(a, b int) bool {
		ea, eb := l.Entries[order[a]], l.Entries[order[b]]
		if (ea.Retired != nil) != (eb.Retired != nil) {
			return ea.Retired != nil
		}
		if ea.Retired != nil {
			return ea.Retired.Revision < eb.Retired.Revision
		}
		return ea.LastUse.Revision < eb.LastUse.Revision
	})
	drop := map[int]bool{}
	for _, i := range order[:len(l.Entries)-MaxEntries] {
		drop[i] = true
	}
	kept := l.Entries[:0]
	for i, e := range l.Entries {
		if !drop[i] {
			kept = append(kept, e)
		}
	}
	l.Entries = kept
	return true
}

// Of lists the entries of the key k names: a local key by provider, name and check
// value; a KMS v2 provider by provider and name, every key id it wrote with (the
// plugin's keyring, not the configuration, holds those).
func (l *Ledger) Of(k transformers.KeyInfo) []Entry {
	if l == nil {
		return nil
	}
	var out []Entry
	for _, e := range l.Entries {
		if e.Provider != k.Provider || e.Name != k.Key {
			continue
		}
		if k.Provider == transformers.ProviderKMSv2 || e.Check == k.Check {
			out = append(out, e)
		}
	}
	return out
}

// Named lists the entries of provider and key name, whatever their check values.
func (l *Ledger) Named(provider, name string) []Entry {
	if l == nil {
		return nil
	}
	var out []Entry
	for _, e := range l.Entries {
		if e.Provider == provider && e.Name == name {
			out = append(out, e)
		}
	}
	return out
}
