package keyledger

import (
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

const (
	key1Prefix = "k8s:enc:aesgcm:v1:key1:"
	key2Prefix = "k8s:enc:aesgcm:v1:key2:"
	vaultKMS   = "k8s:enc:kms:v2:vault:"
)

var t0 = time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)

func aesgcm(name, check string) transformers.KeyInfo {
	return transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: name, Check: check}
}

// rule is secrets read by keys in order, written by the first.
func rule(keys ...transformers.KeyInfo) []transformers.RuleInfo {
	r := transformers.RuleInfo{Resource: "secrets"}
	for _, k := range keys {
		p := transformers.KeyPrefix("k8s:enc:"+k.Provider+":v1:", k.Key)
		if k.Provider == transformers.ProviderKMSv2 {
			p = vaultKMS
		}
		r.ReadPrefixes = append(r.ReadPrefixes, p)
		r.ReadKeys = append(r.ReadKeys, k)
	}
	return []transformers.RuleInfo{r}
}

func inventory(rev int64, counts map[string]int64) *migrate.Inventory {
	ri := migrate.ResourceInventory{Resource: "secrets", Revision: rev}
	for p, n := range counts {
		ri.Buckets = append(ri.Buckets, migrate.Count{Bucket: migrate.Bucket{Prefix: p}, Objects: n})
	}
	return &migrate.Inventory{Resources: []migrate.ResourceInventory{ri}}
}

func TestObserveRotationRetiresTheOldKey(t *testing.T) {
	var l Ledger
	if !l.Observe(Observation{Rules: rule(aesgcm("key1", "c1"))}, t0, 10, 0) {
		t.Fatal("a new write key must be recorded")
	}
	if l.Observe(Observation{Rules: rule(aesgcm("key1", "c1"))}, t0.Add(time.Minute), 11, 0) {
		t.Fatal("the same key within the touch interval must not be written again")
	}
	if !l.Observe(Observation{Rules: rule(aesgcm("key1", "c1"))}, t0.Add(DefaultTouchInterval), 12, 0) {
		t.Fatal("last use must be refreshed after the touch interval")
	}
	// Rotation: key2 writes, key1 still stored.
	now := t0.Add(time.Hour)
	l.Observe(Observation{Rules: rule(aesgcm("key2", "c2"), aesgcm("key1", "c1")), Inventory: inventory(20, map[string]int64{key1Prefix: 5})}, now, 20, 0)
	e1 := l.Of(aesgcm("key1", "c1"))
	if len(e1) != 1 || e1[0].Retired != nil || e1[0].LastStored == nil || e1[0].LastUse.Revision != 12 {
		t.Fatalf("key1 after the rotation = %+v, want stored, not retired, last used at revision 12", e1)
	}
	// An inventory read before key1's last recorded write proves nothing.
	l.Observe(Observation{Rules: rule(aesgcm("key2", "c2"), aesgcm("key1", "c1")), Inventory: inventory(11, map[string]int64{key2Prefix: 5})}, now, 21, 0)
	if e := l.Of(aesgcm("key1", "c1")); e[0].Retired != nil {
		t.Fatalf("an inventory older than the last write must not retire the key: %+v", e)
	}
	// Migrated: none left under key1.
	retiredAt := now.Add(time.Minute)
	l.Observe(Observation{Rules: rule(aesgcm("key2", "c2"), aesgcm("key1", "c1")), Inventory: inventory(30, map[string]int64{key2Prefix: 5})}, retiredAt, 30, 0)
	e1 = l.Of(aesgcm("key1", "c1"))
	if e1[0].Retired == nil || !e1[0].Retired.At.Equal(retiredAt) || e1[0].Retired.Revision != 30 {
		t.Fatalf("key1 = %+v, want retired at revision 30", e1[0])
	}
	if e2 := l.Of(aesgcm("key2", "c2")); len(e2) != 1 || e2[0].Retired != nil {
		t.Fatalf("key2 = %+v, want in use", e2)
	}
	// A key of the same name with another secret is another entry.
	if got := l.Of(aesgcm("key1", "other")); len(got) != 0 {
		t.Fatalf("another secret under key1 matched %+v", got)
	}
}

func TestObserveKMSKeyIDChange(t *testing.T) {
	kms := func(hash string) transformers.KeyInfo {
		return transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: hash}
	}
	var l Ledger
	if l.Observe(Observation{Rules: rule(kms(""))}, t0, 5, 0) {
		t.Fatal("a KMS provider without a key id yet must not be recorded")
	}
	l.Observe(Observation{Rules: rule(kms("sha256:aaaa"))}, t0, 6, 0)
	if !l.Observe(Observation{Rules: rule(kms("sha256:bbbb"))}, t0.Add(time.Minute), 7, 0) {
		t.Fatal("a new key id must be recorded at once")
	}
	all := l.Of(transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault"})
	if len(all) != 2 || all[0].KeyIDHash != "sha256:aaaa" || all[1].KeyIDHash != "sha256:bbbb" || all[1].FirstUse.Revision != 7 {
		t.Fatalf("entries of kms vault = %+v, want both key ids, the second first used at revision 7", all)
	}
	// The migration rewrote everything under the new key id: the old one retires, the
	// new one (written) does not.
	inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 9, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Prefix: vaultKMS, KeyIDHash: "sha256:bbbb"}, Objects: 3}}}}}
	l.Observe(Observation{Rules: rule(kms("sha256:bbbb")), Inventory: inv}, t0.Add(time.Hour), 9, 0)
	all = l.Of(transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault"})
	if all[0].Retired == nil || all[1].Retired != nil {
		t.Fatalf("entries = %+v, want the old key id retired, the new one not", all)
	}
}

// kmsID is KMS v2 provider vault writing under key id hash.
func kmsID(hash string) transformers.KeyInfo {
	return transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: hash}
}

// kmsInventory is an inventory at rev finding objects under vault's key id hash only.
func kmsInventory(rev int64, hash string, objects int64) *migrate.Inventory {
	return &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: rev, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Prefix: vaultKMS, KeyIDHash: hash}, Objects: objects}}}}}
}

// HourlyKMS is the cluster of issue 35: a local key retired, then a KMS plugin whose key
// id changes every hour, each hour's data migrated to the next key id, for n hours. It
// returns the ledger, the local key's retirement and the time after the last hour.
func hourlyKMS(n int, o Observation) (l *Ledger, key1Retired, now time.Time) {
	l = &Ledger{}
	rev := int64(1)
	step := func(at time.Time, ob Observation) {
		rev++
		ob.Retention, ob.RetentionKnown = o.Retention, o.RetentionKnown
		l.Observe(ob, at, rev, 0)
	}
	step(t0, Observation{Rules: rule(aesgcm("key1", "c1"))})
	now = t0
	for i := range n {
		now = t0.Add(time.Duration(i+1) * time.Hour)
		id := fmt.Sprintf("sha256:%04d", i)
		// The migration left nothing under key1 (and under the previous key id).
		step(now, Observation{Rules: rule(kmsID(id), aesgcm("key1", "c1")), Inventory: kmsInventory(rev+1, id, 10)})
		if i == 0 {
			key1Retired = now
		}
	}
	return l, key1Retired, now.Add(time.Hour)
}

// Issue 35: 300 hourly KMS key ids fold into a bounded history of their provider, so the
// local key retired 12 days earlier stays in the ledger.
func TestHourlyKMSKeyIDsDoNotCrowdOutLocalKeys(t *testing.T) {
	for _, o := range []Observation{{}, {Retention: 30 * 24 * time.Hour, RetentionKnown: true}} {
		l, retired, now := hourlyKMS(300, o)
		e1 := l.Of(aesgcm("key1", "c1"))
		if len(e1) != 1 || e1[0].Retired == nil || !e1[0].Retired.At.Equal(retired) {
			t.Fatalf("retention %v: key1 = %+v, want it kept, retired at %s", o.Retention, e1, retired)
		}
		if age := now.Sub(retired); age < 12*24*time.Hour {
			t.Fatalf("key1 retired %s before the end, want at least 12 days", age)
		}
		vault := l.Of(kmsID(""))
		if len(l.Entries) != MaxKMSKeyIDs+2 || len(vault) != MaxKMSKeyIDs+1 {
			t.Fatalf("%d entries, %d of kms vault; want key1, %d key ids and one history entry", len(l.Entries), len(vault), MaxKMSKeyIDs)
		}
		h := vault[0]
		if !h.IsHistory() || h.EarlierKeyIDs != 300-MaxKMSKeyIDs || h.KeyIDHash != "" || h.Retired == nil ||
			h.FirstUse.At != t0.Add(time.Hour) || !strings.Contains(h.String(), fmt.Sprintf("kms vault (%d earlier key ids)", 300-MaxKMSKeyIDs)) {
			t.Fatalf("history entry = %+v (%s), want the %d earliest key ids, retired, first used at %s", h, h, 300-MaxKMSKeyIDs, t0.Add(time.Hour))
		}
		if last := vault[len(vault)-1]; last.KeyIDHash != "sha256:0299" || last.Retired != nil {
			t.Fatalf("last key id = %+v, want sha256:0299 in use", last)
		}
		if l.Forgotten != nil || l.Version != Version {
			t.Fatalf("forgotten %+v, version %d; want nothing forgotten, format %d (history)", l.Forgotten, l.Version, Version)
		}
	}
}

// A history entry holding a key id that may still be stored retires once an inventory
// finds nothing under the provider's key ids it does not list.
func TestKMSHistoryRetiresWhenItsKeyIDsAreGone(t *testing.T) {
	var l Ledger
	rev := int64(1)
	for i := range MaxKMSKeyIDs + 1 {
		rev++
		l.Observe(Observation{Rules: rule(kmsID(fmt.Sprintf("sha256:%04d", i)))}, t0.Add(time.Duration(i)*time.Minute), rev, 0)
	}
	h := l.Of(kmsID(""))[0]
	if !h.IsHistory() || h.EarlierKeyIDs != 1 || h.Retired != nil {
		t.Fatalf("history = %+v, want the first key id folded, not retired (nothing said it is gone)", h)
	}
	// Objects are still stored under the folded key id: the history stays in use.
	inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: rev + 1, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Prefix: vaultKMS, KeyIDHash: "sha256:0000"}, Objects: 2},
		{Bucket: migrate.Bucket{Prefix: vaultKMS, KeyIDHash: fmt.Sprintf("sha256:%04d", MaxKMSKeyIDs)}, Objects: 2}}}}}
	l.Observe(Observation{Rules: rule(kmsID(fmt.Sprintf("sha256:%04d", MaxKMSKeyIDs))), Inventory: inv}, t0.Add(time.Hour), rev+1, 0)
	if h := l.Of(kmsID(""))[0]; h.Retired != nil || h.LastStored == nil {
		t.Fatalf("history = %+v, want stored, not retired", h)
	}
	l.Observe(Observation{Rules: rule(kmsID(fmt.Sprintf("sha256:%04d", MaxKMSKeyIDs))), Inventory: kmsInventory(rev+2, fmt.Sprintf("sha256:%04d", MaxKMSKeyIDs), 4)},
		t0.Add(2*time.Hour), rev+2, 0)
	if h := l.Of(kmsID(""))[0]; h.Retired == nil || h.Retired.Revision != rev+2 {
		t.Fatalf("history = %+v, want retired at revision %d", h, rev+2)
	}
}

// retiredEntries are n local keys, key i first used at revision i+1 and retired at
// t0 + i minutes (revision 10000+i).
func retiredEntries(n int) []Entry {
	out := make([]Entry, n)
	for i := range out {
		name := fmt.Sprintf("k%04d", i)
		out[i] = Entry{Provider: transformers.ProviderAESGCM, Name: name, Check: name, Prefix: "k8s:enc:aesgcm:v1:" + name + ":",
			FirstUse: Event{At: t0, Revision: int64(i + 1)}, LastUse: Event{At: t0, Revision: int64(i + 1)},
			Retired: &Event{At: t0.Add(time.Duration(i) * time.Minute), Revision: int64(10000 + i)}}
	}
	return out
}

// Beyond MaxEntries, only entries retired longer ago than the retention are forgotten;
// those a backup within it may need are kept up to MaxHeldEntries.
func TestLedgerForgetsOnlyWhatNoBackupNeeds(t *testing.T) {
	now := t0.Add(24 * time.Hour)
	l := Ledger{Entries: retiredEntries(MaxEntries + 100)}
	// The first 50 (k0000 to k0049) retired longer ago than the retention.
	retention := now.Sub(t0.Add(50*time.Minute)) + 30*time.Second
	if !l.Observe(Observation{Retention: retention, RetentionKnown: true}, now, 20000, 0) {
		t.Fatal("pruning must be reported as a change")
	}
	if len(l.Entries) != MaxEntries+50 || l.Entries[0].Name != "k0050" {
		t.Fatalf("%d entries from %s, want the 50 retired outside the retention forgotten, the rest kept beyond %d", len(l.Entries), l.Entries[0].Name, MaxEntries)
	}
	if l.Forgotten == nil || !l.Forgotten.At.Equal(t0.Add(49*time.Minute)) || l.Forgotten.Revision != 10049 {
		t.Fatalf("watermark = %+v, want the latest retirement forgotten (k0049)", l.Forgotten)
	}
	// Unknown retention: nothing retired is forgotten below MaxHeldEntries.
	l2 := Ledger{Entries: retiredEntries(MaxEntries + 100)}
	if l2.Observe(Observation{}, now, 20000, 0) || len(l2.Entries) != MaxEntries+100 || l2.Forgotten != nil {
		t.Fatalf("unknown retention: %d entries, watermark %+v; want every entry kept", len(l2.Entries), l2.Forgotten)
	}
	if l2.Version != Version {
		t.Fatalf("a ledger beyond %d entries has format %d, want %d (an older rekey would prune it without a watermark)", MaxEntries, l2.Version, Version)
	}
	// Retention 0 (no backups, every member says so): beyond MaxEntries, retired
	// entries go.
	l3 := Ledger{Entries: retiredEntries(MaxEntries + 100)}
	l3.Observe(Observation{RetentionKnown: true}, now, 20000, 0)
	if len(l3.Entries) != MaxEntries {
		t.Fatalf("retention 0: %d entries, want %d", len(l3.Entries), MaxEntries)
	}
}

// Beyond MaxHeldEntries entries are forgotten even if a backup may need them: the ledger
// records the latest retirement it forgot.
func TestLedgerEvictionRecordsTheWatermark(t *testing.T) {
	now := t0.Add(48 * time.Hour)
	l := Ledger{Version: versionWithoutHistory, Entries: retiredEntries(MaxHeldEntries + 3)}
	l.Observe(Observation{Retention: 30 * 24 * time.Hour, RetentionKnown: true}, now, 20000, 0)
	if len(l.Entries) != MaxHeldEntries || l.Entries[0].Name != "k0003" {
		t.Fatalf("%d entries from %s, want %d, the 3 retired longest ago forgotten", len(l.Entries), l.Entries[0].Name, MaxHeldEntries)
	}
	if l.Forgotten == nil || !l.Forgotten.At.Equal(t0.Add(2*time.Minute)) || l.Version != Version {
		t.Fatalf("watermark %+v, version %d; want k0002's retirement, format %d", l.Forgotten, l.Version, Version)
	}
	if got := l.Named(transformers.ProviderAESGCM, "k0001"); len(got) != 0 {
		t.Fatalf("k0001 still listed: %+v", got)
	}
	// Keys in use are kept as long as retired ones can go; the least recently used goes
	// last, and moves the watermark to the time it was forgotten.
	l = Ledger{}
	for i := range MaxHeldEntries + 1 {
		name := fmt.Sprintf("u%04d", i)
		l.Observe(Observation{Rules: rule(aesgcm(name, name))}, t0.Add(time.Duration(i)*time.Minute), int64(i+1), 0)
	}
	last := t0.Add(MaxHeldEntries * time.Minute)
	if len(l.Entries) != MaxHeldEntries || l.Entries[0].Name != "u0001" || l.Forgotten == nil || !l.Forgotten.At.Equal(last) {
		t.Fatalf("%d entries from %s, watermark %+v; want u0000 forgotten at %s", len(l.Entries), l.Entries[0].Name, l.Forgotten, last)
	}
}

// A ledger without history or watermark keeps format 1, which older rekeys read; a
// newer format than this rekey's is refused.
func TestLedgerFormatVersion(t *testing.T) {
	var l Ledger
	l.Observe(Observation{Rules: rule(aesgcm("key1", "c1"))}, t0, 10, 0)
	if l.Version != versionWithoutHistory {
		t.Fatalf("version %d, want %d", l.Version, versionWithoutHistory)
	}
	if _, err := Decode([]byte(`{"version":3}`)); err == nil || !strings.Contains(err.Error(), "upgrade rekey") {
		t.Fatalf("a newer format: %v, want refused", err)
	}
}

// Every key id of a KMS v2 provider but the newest is superseded; history entries name
// none, and another provider's key ids are its own.
func TestSupersededKMSKeyIDs(t *testing.T) {
	var l Ledger
	l.Observe(Observation{Rules: rule(kmsID("sha256:aaaa"))}, t0, 6, 0)
	if got := l.SupersededKMSKeyIDs(); len(got["vault"]) != 0 {
		t.Fatalf("one key id: superseded %v, want none", got)
	}
	l.Observe(Observation{Rules: rule(kmsID("sha256:bbbb"))}, t0.Add(time.Minute), 7, 0)
	l.Observe(Observation{Rules: rule(kmsID("sha256:cccc"))}, t0.Add(2*time.Minute), 8, 0)
	got := l.SupersededKMSKeyIDs()["vault"]
	if strings.Join(got, ",") != "sha256:aaaa,sha256:bbbb" {
		t.Fatalf("superseded key ids of vault = %v, want aaaa and bbbb", got)
	}
	var nilLedger *Ledger
	if nilLedger.SupersededKMSKeyIDs() != nil {
		t.Fatal("a nil ledger must name nothing")
	}
}
