package cluster

import (
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// A KMS v2 provider holding writes under its first seed after a restart publishes that
// key id as held, not as written: another member whose plugin lacks it stays ready (the
// restarted member wrote nothing under it), and the held key still shows who waits.
func TestFirstSeedHeldIsPublishedAsHeldNotWritten(t *testing.T) {
	now := time.Date(2026, 11, 25, 20, 0, 0, 0, time.UTC)
	kek := func(id string) Key { return Key{Provider: transformers.ProviderKMSv2, Key: "vault", KeyIDHash: id} }
	status := func(id string, heldUntil time.Time) reload.Status {
		kms := transformers.KMSStatus{Name: "vault", Healthy: true, KeyIDHash: id, ReportedKeyIDHash: id, FirstSeedHeldUntil: heldUntil}
		return reload.Status{
			ActiveConfigHash: "sha256:c",
			Resources: []transformers.RuleInfo{{Resource: "secrets", WriteProvider: transformers.ProviderKMSv2, WriteKey: "vault",
				ReadKeys: []Key{kek(id)}, KMS: &kms}},
			KMSProviders: []transformers.KMSStatus{kms},
		}
	}
	restarted := stateFromStatus("a", "", status("sha256:kek2", now.Add(30*time.Second)), nil, now)
	r := restarted.Resources[0]
	if r.Write != (Key{}) || r.Held == nil || r.Held.KeyIDHash != "sha256:kek2" || r.Refused == "" {
		t.Fatalf("restarted member publishes write %v held %v refused %q; want no write, kek2 held", r.Write, r.Held, r.Refused)
	}
	lagging := stateFromStatus("c", "", status("sha256:kek1", time.Time{}), nil, now)
	if missing := missingKeys(lagging, []MemberState{restarted, lagging}, nil); len(missing) != 0 {
		t.Fatalf("the lagging member is not ready because of a key id nobody writes with: %v", missing)
	}
	// Once the hold ends the restarted member writes kek2, and the lagging one is not
	// ready until its plugin decrypts it.
	writing := stateFromStatus("a", "", status("sha256:kek2", time.Time{}), nil, now)
	if missing := missingKeys(lagging, []MemberState{writing, lagging}, nil); len(missing) == 0 {
		t.Fatal("a member whose plugin cannot decrypt the key id another writes under is ready")
	}
}
