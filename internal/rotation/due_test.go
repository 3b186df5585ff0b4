package rotation

import (
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Due is the pure decision of rekey rotate --if-writes-over --if-older-than: either
// bound suffices, a key no apiserver has counted yet never is due, and the line says
// why either way.
func TestConditionDue(t *testing.T) {
	now := time.Date(2026, 11, 27, 12, 0, 0, 0, time.UTC)
	use := func(name string, writes uint64, age time.Duration) KeyUse {
		k := transformers.KeyInfo{Provider: transformers.ProviderAESGCM, Key: name}
		return KeyUse{Key: k, Total: cluster.KeyTotal{Key: k, Writes: writes, FirstSeen: now.Add(-age)}, Known: true}
	}
	for _, tc := range []struct {
		name string
		c    Condition
		keys []KeyUse
		due  bool
		why  string
	}{
		{"no write key", Condition{WritesOver: 10}, nil, false, "no rule to rotate writes with a key"},
		{"over budget", Condition{WritesOver: 1000}, []KeyUse{use("k1", 212345, time.Hour)}, true, "k1 sealed 212,345 values (budget 1,000): rotating"},
		{"too old", Condition{OlderThan: 30 * 24 * time.Hour}, []KeyUse{use("k1", 5, 31*24*time.Hour)}, true, "k1 is 31d old (limit 30d): rotating"},
		{"under both", Condition{WritesOver: 1000, OlderThan: 30 * 24 * time.Hour}, []KeyUse{use("k1", 5, 2*time.Hour)},
			false, "not rotating: k1 sealed 5 values, under 1,000, and is 2h0m0s old, under 30d"},
		{"not counted yet", Condition{WritesOver: 1}, []KeyUse{{Key: transformers.KeyInfo{Key: "k2"}}}, false, "k2 has not been seen by any apiserver yet"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			due, why := tc.c.Due(tc.keys, now)
			if due != tc.due || !strings.Contains(why, tc.why) {
				t.Errorf("Due = %v, %q; want %v, containing %q", due, why, tc.due, tc.why)
			}
		})
	}
	if (Condition{}).Active() || !(Condition{OlderThan: time.Hour}).Active() {
		t.Error("Active: a condition is active when a bound is set")
	}
}
