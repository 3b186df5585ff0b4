package keyledger

import (
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

func TestLedgerIsBounded(t *testing.T) {
	var l Ledger
	for i := range MaxEntries + 10 {
		name := "k" + string(rune('a'+i%26)) + string(rune('a'+i/26))
		l.Observe(Observation{Rules: rule(aesgcm(name, name))}, t0.Add(time.Duration(i)*time.Minute), int64(i+1), 0)
	}
	if len(l.Entries) != MaxEntries {
		t.Fatalf("%d entries, want at most %d", len(l.Entries), MaxEntries)
	}
	if l.Entries[0].FirstUse.Revision != 11 {
		t.Fatalf("oldest kept entry first used at revision %d, want the 10 least recently used forgotten", l.Entries[0].FirstUse.Revision)
	}
}
