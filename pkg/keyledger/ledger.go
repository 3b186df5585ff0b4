package keyledger

import (
	"cmp"
	"fmt"
	"maps"
	"slices"
	"time"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Version is the format version of Ledger. A ledger is written with the lowest
// version that holds what it says (formatVersion): version 1 has no KMS history entry,
// no watermark and at most MaxEntries entries, so a rekey that knows only version 1
// keeps reading and writing it; it refuses a version 2 ledger (and with it any drop its
// retention guard cannot judge) rather than prune it blindly or write it back without
// the watermark.
const Version = 2

// versionWithoutHistory is the format of a ledger without KMS history entries, without
// a watermark and within MaxEntries.
const versionWithoutHistory = 1

// Key is where the ledger of the cluster under coordinationPrefix is kept.
func Key(coordinationPrefix string) string { return coordination.Ledger(coordinationPrefix) }

// MaxEntries is how many entries the ledger keeps once it may forget freely: beyond
// it, the entries retired longer ago than the largest --backup-retention the members
// publish (Observation.Retention) are forgotten, those retired longest ago first. A
// cluster rotating weekly for years stays far below it: a KMS v2 provider takes at
// most MaxKMSKeyIDs+1 entries however often its key id changes.
const MaxEntries = 256

// MaxHeldEntries bounds the ledger. Entries a backup within the retention may need
// (retired within it, retired while the retention is unknown, or not retired at all)
// are kept beyond MaxEntries up to it; beyond it they are forgotten too, those retired
// longest ago first, then the least recently used, and the ledger records when
// (Ledger.Forgotten) so that the retention guard refuses to drop a key it does not
// know that may have been one of them. At about 400 bytes an entry, the ledger stays
// well below etcd's request limit.
const MaxHeldEntries = 1024

// MaxKMSKeyIDs is how many key ids of one KMS v2 provider the ledger lists one by one.
// Older ones fold into the provider's history entry (Entry.EarlierKeyIDs): the
// retention guard looks a KMS v2 provider up by name, so the history holds the provider
// as long as its latest retired key id needs it, and a plugin whose key id changes
// hourly cannot crowd local keys out of the ledger.
const MaxKMSKeyIDs = 16

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
	// EarlierKeyIDs is set on a KMS v2 provider's history entry (KeyIDHash empty): how
	// many of its key ids, no longer listed one by one, the entry stands for. Its
	// events are theirs together: the first first use, the last last use and storage,
	// and the latest retirement (none while one of them may still be stored: an
	// inventory finds objects under a key id of the provider that the ledger does not
	// list).
	EarlierKeyIDs int `json:"earlierKeyIDs,omitempty"`
}

// IsHistory reports whether e is a KMS v2 provider's history entry.
func (e Entry) IsHistory() bool { return e.EarlierKeyIDs > 0 }

// Info is the entry as a chain entry names it.
func (e Entry) Info() transformers.KeyInfo {
	return transformers.KeyInfo{Provider: e.Provider, Key: e.Name, Check: e.Check, KeyIDHash: e.KeyIDHash}
}

// String is "aesgcm key1 (check a1b2…)" or "kms vault (key id sha256:…)".
func (e Entry) String() string {
	s := e.Provider + " " + e.Name
	switch {
	case e.IsHistory():
		s += fmt.Sprintf(" (%d earlier key ids)", e.EarlierKeyIDs)
	case e.KeyIDHash != "":
		s += " (key id " + e.KeyIDHash + ")"
	case e.Check != "":
		s += " (check " + e.Check + ")"
	}
	return s
}

// sameKey reports whether e records the key k: provider, name and check value, and for
// KMS v2 the key id hash. A history entry is no one key.
func (e Entry) sameKey(k transformers.KeyInfo) bool {
	return !e.IsHistory() && e.Provider == k.Provider && e.Name == k.Key && e.Check == k.Check && e.KeyIDHash == k.KeyIDHash
}

// Ledger is every key the cluster wrote with.
type Ledger struct {
	Version int     `json:"version"`
	Entries []Entry `json:"entries"`
	// Forgotten is the watermark of what the ledger forgot to stay within its bound:
	// the latest retirement among the entries it dropped (for an entry dropped before
	// it retired, the time it was dropped). Nil while it never dropped one. A key the
	// ledger does not know may be one of them, retired up to Forgotten.At, so a
	// snapshot within the retention of that may need it (guard.CheckRetention refuses
	// to drop it).
	Forgotten *Event `json:"forgotten,omitempty"`
}

// formatVersion is the lowest format version that holds l.
func (l *Ledger) formatVersion() int {
	if l.Forgotten != nil || len(l.Entries) > MaxEntries || slices.ContainsFunc(l.Entries, Entry.IsHistory) {
		return Version
	}
	return versionWithoutHistory
}

// Observation is what one member sees now.
type Observation struct {
	// Rules are the member's running rules (reload.Agent.Rules): their writers are the
	// keys it writes with.
	Rules []transformers.RuleInfo
	// Inventory is the member's latest inventory, or nil.
	Inventory *migrate.Inventory
	// Retention is the largest --backup-retention the cluster's members publish, when
	// RetentionKnown. Unknown (a member does not publish it, or the caller does not
	// say), every retired entry counts as one a backup may need: nothing is forgotten
	// below MaxHeldEntries.
	Retention      time.Duration
	RetentionKnown bool
}

// held reports whether a backup within o's retention may need e at now: e is not
// retired, the retention is unknown, or e retired less than the retention ago.
func (o Observation) held(e Entry, now time.Time) bool {
	return e.Retired == nil || !o.RetentionKnown || now.Sub(e.Retired.At) < o.Retention
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
// member observes it. It then keeps l bounded: KMS v2 key ids beyond MaxKMSKeyIDs per
// provider fold into the provider's history entry, entries no backup within the
// retention needs are forgotten beyond MaxEntries, and any entry beyond
// MaxHeldEntries, recording the watermark (Ledger.Forgotten). A key written now is
// never folded or forgotten.
func (l *Ledger) Observe(o Observation, now time.Time, rev int64, touch time.Duration) bool {
	if touch <= 0 {
		touch = DefaultTouchInterval
	}
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
	written := map[transformers.KeyInfo]bool{}
	for i := range writing {
		written[l.Entries[i].Info()] = true
	}
	if l.foldKMS(written) {
		changed = true
	}
	if l.prune(o, ev, written) {
		changed = true
	}
	// The format follows the content: it changes only with a change reported above.
	l.Version = l.formatVersion()
	return changed
}

// observeStored folds an inventory's counts of entry i into it.
func (l *Ledger) observeStored(i int, inv *migrate.Inventory, writing bool, ev Event, touch time.Duration) bool {
	e := &l.Entries[i]
	objects, oldest := stored(*e, inv, l.listedKeyIDs(*e))
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

// listedKeyIDs are, for a KMS v2 history entry, the key ids of its provider the ledger
// lists one by one (the history stands for every other one); nil for any other entry.
func (l *Ledger) listedKeyIDs(h Entry) map[string]bool {
	if !h.IsHistory() {
		return nil
	}
	listed := map[string]bool{}
	for _, e := range l.Entries {
		if !e.IsHistory() && e.Provider == h.Provider && e.Name == h.Name {
			listed[e.KeyIDHash] = true
		}
	}
	return listed
}

// stored counts the objects inv found under e, and returns the oldest revision any
// of its resources was read at (0 when it covers none). A history entry counts the
// objects of its prefix under any key id not in listed (a bucket without a key id
// included: it may be one of them).
func stored(e Entry, inv *migrate.Inventory, listed map[string]bool) (objects, oldest int64) {
	for _, ri := range inv.Resources {
		if oldest == 0 || ri.Revision < oldest {
			oldest = ri.Revision
		}
		for _, b := range ri.Buckets {
			if b.Prefix != e.Prefix {
				continue
			}
			switch {
			case e.IsHistory():
				if !listed[b.KeyIDHash] {
					objects += b.Objects
				}
			case e.KeyIDHash == "" || b.KeyIDHash == e.KeyIDHash:
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

// foldKMS keeps at most MaxKMSKeyIDs key ids of each KMS v2 provider listed one by
// one: the others, retired longest ago first, then the least recently used, fold into
// the provider's history entry. Key ids written now (written) are never folded.
func (l *Ledger) foldKMS(written map[transformers.KeyInfo]bool) bool {
	type provider struct{ name, prefix string }
	listed := map[provider][]int{}
	for i, e := range l.Entries {
		if e.Provider == transformers.ProviderKMSv2 && !e.IsHistory() {
			p := provider{e.Name, e.Prefix}
			listed[p] = append(listed[p], i)
		}
	}
	fold := map[int]bool{} // the key id entries to fold
	for _, idx := range listed {
		if len(idx) <= MaxKMSKeyIDs {
			continue
		}
		var candidates []int
		for _, i := range idx {
			if !written[l.Entries[i].Info()] {
				candidates = append(candidates, i)
			}
		}
		sortForgetOrder(l.Entries, candidates)
		for _, i := range candidates[:min(len(candidates), len(idx)-MaxKMSKeyIDs)] {
			fold[i] = true
		}
	}
	if len(fold) == 0 {
		return false
	}
	// Fold in ledger order: a new history entry takes the place of the first key id
	// folded into it.
	hist := map[provider]int{}
	for i, e := range l.Entries {
		if e.IsHistory() {
			hist[provider{e.Name, e.Prefix}] = i
		}
	}
	drop := map[int]bool{}
	for _, i := range slices.Sorted(maps.Keys(fold)) {
		e := l.Entries[i]
		p := provider{e.Name, e.Prefix}
		h, ok := hist[p]
		if !ok {
			l.Entries[i] = Entry{Provider: e.Provider, Name: e.Name, Prefix: e.Prefix, FirstUse: e.FirstUse, LastUse: e.LastUse,
				LastStored: e.LastStored, Retired: e.Retired, EarlierKeyIDs: 1}
			hist[p] = i
			continue
		}
		l.Entries[h] = mergeHistory(l.Entries[h], e)
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

// mergeHistory folds the key id entry e into the history entry h.
func mergeHistory(h, e Entry) Entry {
	h.EarlierKeyIDs++
	if e.FirstUse.Revision < h.FirstUse.Revision {
		h.FirstUse = e.FirstUse
	}
	if e.LastUse.Revision > h.LastUse.Revision {
		h.LastUse = e.LastUse
	}
	h.LastStored = later(h.LastStored, e.LastStored)
	if h.Retired == nil || e.Retired == nil {
		h.Retired = nil // one of them may still be stored
	} else {
		h.Retired = later(h.Retired, e.Retired)
	}
	return h
}

func later(a, b *Event) *Event {
	switch {
	case a == nil:
		return b
	case b == nil, a.Revision >= b.Revision:
		return a
	}
	return b
}

// sortForgetOrder sorts the entry indexes idx in the order they are forgotten: retired
// ones first, those retired longest ago first, then the least recently used.
func sortForgetOrder(entries []Entry, idx []int) {
	slices.SortStableFunc(idx, func(a, b int) int {
		ea, eb := entries[a], entries[b]
		if (ea.Retired != nil) != (eb.Retired != nil) {
			if ea.Retired != nil {
				return -1
			}
			return 1
		}
		if ea.Retired != nil {
			return cmp.Compare(ea.Retired.Revision, eb.Retired.Revision)
		}
		return cmp.Compare(ea.LastUse.Revision, eb.LastUse.Revision)
	})
}

// prune keeps l within its bounds. Beyond MaxEntries it forgets the entries no backup
// within o's retention needs, retired longest ago first. Beyond MaxHeldEntries it
// forgets the others too, retired longest ago first, then the least recently used;
// never one written now (written). Every entry it forgets moves the watermark
// (Ledger.Forgotten) to its retirement, or to now if it was not retired.
func (l *Ledger) prune(o Observation, now Event, written map[transformers.KeyInfo]bool) bool {
	if len(l.Entries) <= MaxEntries {
		return false
	}
	var free, held []int
	for i, e := range l.Entries {
		switch {
		case written[e.Info()]:
		case o.held(e, now.At):
			held = append(held, i)
		default:
			free = append(free, i)
		}
	}
	sortForgetOrder(l.Entries, free)
	sortForgetOrder(l.Entries, held)
	drop := map[int]bool{}
	for _, i := range free[:min(len(free), len(l.Entries)-MaxEntries)] {
		drop[i] = true
	}
	if over := len(l.Entries) - len(drop) - MaxHeldEntries; over > 0 {
		for _, i := range held[:min(len(held), over)] {
			drop[i] = true
		}
	}
	if len(drop) == 0 {
		return false
	}
	kept := l.Entries[:0]
	for i, e := range l.Entries {
		if !drop[i] {
			kept = append(kept, e)
			continue
		}
		mark := now
		if e.Retired != nil {
			mark = *e.Retired
		}
		if l.Forgotten == nil || mark.At.After(l.Forgotten.At) {
			l.Forgotten = &mark
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

// SupersededKMSKeyIDs lists, per KMS v2 provider name, the key id hashes the ledger
// shows superseded: another key id of the same provider was first written with after
// it was. Every listed key id of a provider but its newest is one. A plugin that
// reports one of them as its current key id again reuses it (KMS v2 forbids that, and
// the material behind the id cannot be compared), and pkg/transformers/kmsv2 refuses it
// as a write key. Key ids folded into a history entry are no longer known one by one
// and are not listed.
func (l *Ledger) SupersededKMSKeyIDs() map[string][]string {
	if l == nil {
		return nil
	}
	newest := map[string]int64{} // provider name → the newest first use among its key ids
	for _, e := range l.Entries {
		if e.Provider == transformers.ProviderKMSv2 && !e.IsHistory() && e.KeyIDHash != "" {
			newest[e.Name] = max(newest[e.Name], e.FirstUse.Revision)
		}
	}
	out := map[string][]string{}
	for _, e := range l.Entries {
		if e.Provider == transformers.ProviderKMSv2 && !e.IsHistory() && e.KeyIDHash != "" && e.FirstUse.Revision < newest[e.Name] {
			out[e.Name] = append(out[e.Name], e.KeyIDHash)
		}
	}
	return out
}
