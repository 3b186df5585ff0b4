package guard

import (
	"context"
	"encoding/base64"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var (
	secret1 = []byte("0123456789abcdef0123456789abcdef")
	secret2 = []byte("fedcba9876543210fedcba9876543210")
)

// aesgcmConfig is secrets encrypted by the named aesgcm keys in order.
func aesgcmConfig(t *testing.T, keys ...string) *config.Config {
	t.Helper()
	doc := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - aesgcm:\n      keys:\n"
	for _, k := range keys {
		s := secret1
		if k == "key2" {
			s = secret2
		}
		doc += "      - name: " + k + "\n        secret: " + base64.StdEncoding.EncodeToString(s) + "\n"
	}
	doc += "  - identity: {}\n"
	cfg, err := config.Parse([]byte(doc), strings.Join(keys, "+")+".yaml", config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// After a rotation from key1 to key2 and the migration, removing key1 is refused while
// a snapshot within the retention may hold values under it, and allowed after.
func TestRetentionHoldsARetiredKey(t *testing.T) {
	t0 := time.Date(2026, 11, 24, 10, 0, 0, 0, time.UTC)
	before, rotated, final := aesgcmConfig(t, "key1"), aesgcmConfig(t, "key2", "key1"), aesgcmConfig(t, "key2")
	var l keyledger.Ledger
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(before)}, t0, 10, 0)
	migrated := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 40, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "key2", Prefix: "k8s:enc:aesgcm:v1:key2:"}, Objects: 3}}}}}
	retiredAt := t0.Add(time.Hour)
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(rotated), Inventory: migrated}, retiredAt, 40, 0)

	clk := clocktesting.NewFakePassiveClock(retiredAt.Add(24 * time.Hour))
	reads := 0
	g := NewRetention(RetentionOptions{
		Retention: 7 * 24 * time.Hour,
		Ledger:    func(context.Context) (*keyledger.Ledger, error) { reads++; return &l, nil },
		Clock:     clk,
	})
	err := g(rotated, final)
	var rerr *RefusedError
	if !errors.As(err, &rerr) || rerr.Check != Retention || !errors.Is(err, ErrRefused) {
		t.Fatalf("removing key1 a day after its retirement: %v, want a Retention refusal", err)
	}
	check := transformers.CheckValue(transformers.AESGCMPrefix, secret1)
	for _, want := range []string{"a snapshot up to 7d old may hold values under aesgcm key1 (check " + check + ")", "keep it until 2026-12-01T11:00Z, when --backup-retention 168h0m0s lets it go",
		"retired at 2026-11-24T11:00Z, revision 40", "sooner only if no snapshot older than 1d is kept: a --backup-retention of 1d or less"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal does not say %q:\n%s", want, err)
		}
	}
	if strings.Contains(err.Error(), string(secret1)) || strings.Contains(err.Error(), base64.StdEncoding.EncodeToString(secret1)) {
		t.Fatal("the refusal shows key material")
	}
	// Not dropping anything reads no ledger; dropping nothing is allowed.
	if err := g(before, rotated); err != nil || reads != 1 {
		t.Fatalf("adding a key: %v (ledger reads %d), want allowed without reading the ledger", err, reads)
	}
	clk.SetTime(retiredAt.Add(7 * 24 * time.Hour))
	if err := g(rotated, final); err != nil {
		t.Fatalf("removing key1 once the retention has passed: %v", err)
	}
	// Off by default.
	if err := NewRetention(RetentionOptions{Ledger: func(context.Context) (*keyledger.Ledger, error) { return &l, nil }})(rotated, final); err != nil {
		t.Fatalf("retention 0: %v", err)
	}
}

// A key no inventory has shown gone from storage is held for the whole retention from
// now; another secret under the same name is not that key.
func TestRetentionUnretiredAndOtherSecret(t *testing.T) {
	t0 := time.Date(2026, 11, 24, 10, 0, 0, 0, time.UTC)
	rotated, final := aesgcmConfig(t, "key2", "key1"), aesgcmConfig(t, "key2")
	var l keyledger.Ledger
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(aesgcmConfig(t, "key1"))}, t0, 10, 0)
	holds := CheckRetention(&l, ConfigKeys(rotated), ConfigKeys(final), time.Hour, t0.Add(48*time.Hour))
	if len(holds) != 1 || !holds[0].Until.Equal(t0.Add(49*time.Hour)) || !strings.Contains(holds[0].String(), "a snapshot taken now may hold values") {
		t.Fatalf("holds = %v, want key1 held until now + retention", holds)
	}
	// The ledger's key1 has another check value: the key1 dropped is not one it knows.
	l.Entries[0].Check = "0000000000000000"
	if holds := CheckRetention(&l, ConfigKeys(rotated), ConfigKeys(final), time.Hour, t0); len(holds) != 0 {
		t.Fatalf("holds = %v, want none for a secret the ledger never recorded", holds)
	}
}

// secretsRule is secrets read by keys in order, written by the first, as a member's
// running rules describe it (KMS v2 keys under vault's prefix).
func secretsRule(keys ...transformers.KeyInfo) []transformers.RuleInfo {
	r := transformers.RuleInfo{Resource: "secrets"}
	for _, k := range keys {
		p := transformers.KeyPrefix("k8s:enc:"+k.Provider+":v1:", k.Key)
		if k.Provider == transformers.ProviderKMSv2 {
			p = "k8s:enc:kms:v2:vault:"
		}
		r.ReadPrefixes = append(r.ReadPrefixes, p)
		r.ReadKeys = append(r.ReadKeys, k)
	}
	return []transformers.RuleInfo{r}
}

// secretsChain is the guard's view of a configuration whose secrets rule reads keys.
func secretsChain(keys ...transformers.KeyInfo) []transformers.Entry[transformers.KeyInfo] {
	return []transformers.Entry[transformers.KeyInfo]{{Resources: []string{"secrets"}, Items: keys}}
}

// Issue 35: a local key retired 12 days ago, then a KMS plugin whose key id changed every
// hour for 300 hours; with a 30-day retention the ledger still knows the local key and
// the guard refuses to drop it.
func TestRetentionHoldsALocalKeyPastHourlyKMSKeyIDs(t *testing.T) {
	t0 := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	key1 := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "key1", Check: "c1"}
	kms := func(i int) transformers.KeyInfo {
		return transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: fmt.Sprintf("sha256:%04d", i)}
	}
	var l keyledger.Ledger
	rev := int64(1)
	l.Observe(keyledger.Observation{Rules: secretsRule(key1)}, t0, rev, 0)
	var now, retired time.Time
	for i := range 300 {
		now, rev = t0.Add(time.Duration(i+1)*time.Hour), rev+2
		inv := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: rev, Buckets: []migrate.Count{
			{Bucket: migrate.Bucket{Prefix: "k8s:enc:kms:v2:vault:", KeyIDHash: kms(i).KeyIDHash}, Objects: 10}}}}}
		l.Observe(keyledger.Observation{Rules: secretsRule(kms(i), key1), Inventory: inv}, now, rev, 0)
		if i == 0 {
			retired = now
		}
	}
	if now.Sub(retired) < 12*24*time.Hour {
		t.Fatalf("key1 retired %s before now, want 12 days", now.Sub(retired))
	}
	current, next := secretsChain(transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault"}, key1),
		secretsChain(transformers.KeyInfo{Provider: transformers.ProviderKMSv2, Key: "vault"})
	holds := CheckRetention(&l, current, next, 30*24*time.Hour, now)
	if len(holds) != 1 || holds[0].Key.Name != "key1" || !holds[0].Until.Equal(retired.Add(30*24*time.Hour)) {
		t.Fatalf("holds = %v, want key1 held until %s", holds, retired.Add(30*24*time.Hour))
	}
	// Dropping the KMS provider is held by every key id it wrote with, the folded ones
	// included, in a bounded refusal.
	holds = CheckRetention(&l, current, secretsChain(key1), 30*24*time.Hour, now)
	if len(holds) == 0 || len(holds) > 20 {
		t.Fatalf("dropping kms vault: %d holds, want a bounded number", len(holds))
	}
}

// Issue 35: the ledger forgot keys to stay within its bound; dropping a key it does not
// know is refused while a key it forgot may be needed, and allowed after.
func TestRetentionRefusesAnUnknownKeyAfterTheWatermark(t *testing.T) {
	t0 := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	var l keyledger.Ledger
	for i := range keyledger.MaxHeldEntries + 1 {
		name := fmt.Sprintf("k%04d", i)
		l.Entries = append(l.Entries, keyledger.Entry{Provider: transformers.ProviderAESGCM, Name: name, Check: name, Prefix: "k8s:enc:aesgcm:v1:" + name + ":",
			FirstUse: keyledger.Event{At: t0, Revision: int64(i + 1)}, LastUse: keyledger.Event{At: t0, Revision: int64(i + 1)},
			Retired: &keyledger.Event{At: t0.Add(time.Duration(i) * time.Minute), Revision: int64(5000 + i)}})
	}
	retention := 7 * 24 * time.Hour
	now := t0.Add(2 * 24 * time.Hour)
	l.Observe(keyledger.Observation{Retention: retention, RetentionKnown: true}, now, 9000, 0)
	if l.Forgotten == nil || !l.Forgotten.At.Equal(t0) {
		t.Fatalf("watermark = %+v, want k0000's retirement at %s", l.Forgotten, t0)
	}
	forgotten := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "k0000", Check: "k0000"}
	other := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "other", Check: "0000"}
	keep := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: "k0500", Check: "k0500"}
	for _, k := range []transformers.KeyInfo{forgotten, other} {
		holds := CheckRetention(&l, secretsChain(keep, k), secretsChain(keep), retention, now)
		if len(holds) != 1 || holds[0].Forgotten == nil || !holds[0].Until.Equal(t0.Add(retention)) {
			t.Fatalf("dropping %s: holds %v, want it held until %s", k.Key, holds, t0.Add(retention))
		}
		for _, want := range []string{"the key ledger does not know aesgcm " + k.Key, "forgot keys retired up to 2026-11-01T10:00Z (revision 5000)",
			"keep it until 2026-11-08T10:00Z", "--backup-retention 168h0m0s"} {
			if !strings.Contains(holds[0].String(), want) {
				t.Errorf("hold does not say %q: %s", want, holds[0])
			}
		}
	}
	if holds := CheckRetention(&l, secretsChain(keep, other), secretsChain(keep), retention, t0.Add(retention)); len(holds) != 0 {
		t.Fatalf("once every forgotten key is past the retention: holds %v, want none", holds)
	}
	// Without a watermark, a key the ledger does not know was never recorded: not held.
	l.Forgotten = nil
	if holds := CheckRetention(&l, secretsChain(keep, other), secretsChain(keep), retention, now); len(holds) != 0 {
		t.Fatalf("no watermark: holds %v, want none", holds)
	}
}

// Right after a retirement the refusal names the retention, its source, the key and when
// it may go; it never suggests a retention of 0s.
func TestRetentionRefusalRightAfterRetirement(t *testing.T) {
	t0 := time.Date(2026, 11, 24, 10, 0, 0, 0, time.UTC)
	rotated, final := aesgcmConfig(t, "key2", "key1"), aesgcmConfig(t, "key2")
	var l keyledger.Ledger
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(aesgcmConfig(t, "key1"))}, t0, 10, 0)
	migrated := &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Revision: 40, Buckets: []migrate.Count{
		{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "key2", Prefix: "k8s:enc:aesgcm:v1:key2:"}, Objects: 3}}}}}
	l.Observe(keyledger.Observation{Rules: transformers.DescribeRules(rotated), Inventory: migrated}, t0.Add(time.Hour), 40, 0)
	err := CheckRetentionChange(context.Background(), RetentionOptions{
		Retention: time.Hour, Source: "published by apiserver a",
		Ledger: func(context.Context) (*keyledger.Ledger, error) { return &l, nil },
		Clock:  clocktesting.NewFakePassiveClock(t0.Add(time.Hour + time.Second)),
	}, rotated, final)
	if err == nil {
		t.Fatal("removing key1 a second after its retirement with a 1h retention: allowed")
	}
	for _, want := range []string{"aesgcm key1 (check ", "keep it until 2026-11-24T12:00Z", "--backup-retention 1h0m0s published by apiserver a"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("refusal does not say %q:\n%s", want, err)
		}
	}
	if strings.Contains(err.Error(), "0s or less") || strings.Contains(err.Error(), "below 0s") {
		t.Errorf("refusal suggests a zero retention:\n%s", err)
	}
	// Published by an apiserver, the refusal is recognised as the retention guard's.
	hold, ok := RetentionRefusal("new configuration refused: " + err.Error())
	if !ok || !strings.HasPrefix(hold, "a snapshot up to 1h old may hold values under aesgcm key1") {
		t.Fatalf("RetentionRefusal = %q, %v; want its first hold", hold, ok)
	}
	if _, ok := RetentionRefusal((&RefusedError{Check: Change, Next: "x"}).Error()); ok {
		t.Fatal("a change refusal taken for the retention guard's")
	}
}
