package cluster

import (
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// A member whose KMS plugin reports a refused reused key id publishes it, and the
// cluster status names it under the KMSKeyIDReuse condition's list.
func TestKMSKeyIDReuseIsPublishedAndListed(t *testing.T) {
	at := time.Date(2026, 11, 1, 10, 0, 0, 0, time.UTC)
	st := reload.Status{KMSProviders: []transformers.KMSStatus{{Name: "vault", Healthy: true, KeyIDHash: "sha256:bbbb",
		ReportedKeyIDHash: "sha256:bbbb", ReusedKeyIDHash: "sha256:aaaa", ReusedSince: at}}}
	m := stateFromStatus("a", "v", st, nil, at)
	if len(m.KMS) != 1 || m.KMS[0].ReusedKeyIDHash != "sha256:aaaa" || !m.KMS[0].ReusedSince.Equal(at) {
		t.Fatalf("member state KMS = %+v, want the reuse published", m.KMS)
	}
	other := stateFromStatus("b", "v", reload.Status{KMSProviders: []transformers.KMSStatus{{Name: "vault", Healthy: true, KeyIDHash: "sha256:bbbb"}}}, nil, at)
	got := kmsKeyIDReuses([]MemberState{m, other})
	if len(got) != 1 || !strings.Contains(got[0], "a: kms vault key id sha256:aaaa") {
		t.Fatalf("reuses = %q", got)
	}
	if kmsKeyIDReuses([]MemberState{other}) != nil {
		t.Fatal("no reuse must list nothing")
	}
}
