package guard

import (
	"context"
	"encoding/base64"
	"errors"
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
	for _, want := range []string{"a snapshot up to 7d old may hold values under aesgcm key1 (check " + check + ")", "keep it until 2026-12-01T11:00Z", "--backup-retention", "retired at 2026-11-24T11:00Z, revision 40"} {
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
