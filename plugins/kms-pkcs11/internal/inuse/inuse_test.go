package inuse

import (
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var now = time.Date(2026, 3, 1, 12, 0, 0, 0, time.UTC)

func ev(ago time.Duration) *keyledger.Event { return &keyledger.Event{At: now.Add(-ago), Revision: 7} }

func kms(name, hash string, retiredAgo time.Duration, history int) keyledger.Entry {
	e := keyledger.Entry{Provider: transformers.ProviderKMSv2, Name: name, KeyIDHash: hash, EarlierKeyIDs: history,
		FirstUse: *ev(100 * time.Hour), LastUse: *ev(retiredAgo)}
	if retiredAgo > 0 {
		e.Retired = ev(retiredAgo)
	}
	return e
}

func TestHolds(t *testing.T) {
	mine, other := HashKeyID("kek:v1"), HashKeyID("kek:v2")
	for _, c := range []struct {
		name  string
		l     *keyledger.Ledger
		want  int
		check func(t *testing.T, h []string)
	}{
		{"retired within the retention", &keyledger.Ledger{Entries: []keyledger.Entry{kms("hsm", mine, time.Hour, 0), kms("hsm", other, 0, 0)}}, 1, nil},
		{"retired longer ago than the retention", &keyledger.Ledger{Entries: []keyledger.Entry{kms("hsm", mine, 48*time.Hour, 0), kms("hsm", other, 0, 0)}}, 0, nil},
		{"only another key id of the provider in use", &keyledger.Ledger{Entries: []keyledger.Entry{kms("hsm", other, 0, 0)}}, 0, nil},
		{"folded into the provider's history, which is held", &keyledger.Ledger{Entries: []keyledger.Entry{kms("hsm", "", 2*time.Hour, 17), kms("hsm", other, 0, 0)}}, 1,
			func(t *testing.T, h []string) {
				if !strings.Contains(h[0], "17 earlier key ids") {
					t.Errorf("hold %q does not name the history entry", h[0])
				}
			}},
		{"unknown, but the ledger forgot keys within the retention", &keyledger.Ledger{Forgotten: ev(3 * time.Hour)}, 1,
			func(t *testing.T, h []string) {
				if !strings.Contains(h[0], "forgot keys retired up to") {
					t.Errorf("hold %q does not name the watermark", h[0])
				}
			}},
		{"unknown, and nothing forgotten", &keyledger.Ledger{}, 0, nil},
	} {
		t.Run(c.name, func(t *testing.T) {
			hs := holds(c.l, mine, 24*time.Hour, "", now)
			var texts []string
			for _, h := range hs {
				texts = append(texts, h.String())
			}
			if len(hs) != c.want {
				t.Fatalf("%d holds, want %d: %q", len(hs), c.want, texts)
			}
			if c.check != nil {
				c.check(t, texts)
			}
		})
	}
}

func TestEffectiveRetention(t *testing.T) {
	members := []cluster.MemberState{{APIServerID: "a", BackupRetention: "48h0m0s"}, {APIServerID: "b", BackupRetention: "1h0m0s"}}
	d, src, err := effectiveRetention(members, Options{Retention: 24 * time.Hour})
	if err != nil || d != 48*time.Hour || !strings.Contains(src, "apiserver a") {
		t.Fatalf("a member's longer retention: %v %q %v", d, src, err)
	}
	old := append(members, cluster.MemberState{APIServerID: "c"})
	if _, _, err := effectiveRetention(old, Options{}); err == nil || !strings.Contains(err.Error(), "apiserver c does not publish") {
		t.Fatalf("a member that does not publish its retention, no flag: %v", err)
	}
	if d, _, err := effectiveRetention(old, Options{Retention: 72 * time.Hour, RetentionSet: true}); err != nil || d != 72*time.Hour {
		t.Fatalf("with the flag given: %v %v", d, err)
	}
}

func TestResourceDir(t *testing.T) {
	for key, want := range map[string]string{
		"/registry/secrets/ns/a":                "/registry/secrets/",
		"/registry/example.com/widgets/ns/w":    "/registry/example.com/widgets/",
		"/registry/apiregistration.k8s.io/apis": "/registry/apiregistration.k8s.io/apis/",
	} {
		if got := resourceDir("/registry/", key); got != want {
			t.Errorf("resourceDir(%s) = %s, want %s", key, got, want)
		}
	}
}

func TestMembersUsing(t *testing.T) {
	h := HashKeyID("kek:v1")
	got := membersUsing([]cluster.MemberState{
		{APIServerID: "a", KMS: []cluster.KMSState{{Name: "hsm", KeyIDHash: h, ReportedKeyIDHash: h}}},
		{APIServerID: "b", KMS: []cluster.KMSState{{Name: "hsm", KeyIDHash: HashKeyID("kek:v2"), HeldKeyIDHash: h}}},
		{APIServerID: "c", KMS: []cluster.KMSState{{Name: "hsm", KeyIDHash: HashKeyID("kek:v2")}}},
	}, h)
	if len(got) != 2 || !strings.Contains(got[0], "apiserver a") || !strings.Contains(got[1], "holds it back") {
		t.Fatalf("membersUsing: %q", got)
	}
}
