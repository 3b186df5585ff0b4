package encryptionstate

import (
	"context"
	"encoding/base64"
	"encoding/json"
	"strings"
	"testing"
	"time"

	"k8s.io/utils/clock"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var secret1 = base64.StdEncoding.EncodeToString([]byte("0123456789abcdef0123456789abcdef"))

func testConfig(t *testing.T) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: [secrets]
  providers:
  - aesgcm:
      keys: [{name: key1, secret: `+secret1+`}]
  - identity: {}
`), "test", config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// An inventory with objects under the write key, in plaintext and under a retired key
// becomes a state naming each key by fingerprint (never its secret), the retired one by
// the ledger's check value, with first use, age and writes from the key totals.
func TestBuild(t *testing.T) {
	cfg := testConfig(t)
	taken := time.Date(2026, 11, 28, 8, 0, 30, 0, time.UTC)
	check := transformers.CheckValue(transformers.AESGCMPrefix, []byte("0123456789abcdef0123456789abcdef"))
	inv := &migrate.Inventory{TakenAt: taken, ConfigHash: cfg.Hash, Resources: []migrate.ResourceInventory{{
		Resource: "secrets", Revision: 42, WritePrefix: "k8s:enc:aesgcm:v1:key1:", Objects: 4, Stale: 1, Plaintext: 1, Unreadable: 1,
		Buckets: []migrate.Count{
			{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "key1", Prefix: "k8s:enc:aesgcm:v1:key1:", KnownKey: true}, Objects: 2},
			{Bucket: migrate.Bucket{Provider: "identity", KnownKey: true, Stale: true}, Objects: 1},
			{Bucket: migrate.Bucket{Provider: "aesgcm", Key: "old", Prefix: "k8s:enc:aesgcm:v1:old:", Stale: true}, Objects: 1},
		},
	}}}
	yes := true
	first := taken.Add(-90 * time.Minute)
	in := Input{
		ObservedBy: "a", Config: cfg, FIPS: transformers.FIPSOn, Inventory: inv,
		Members: []cluster.MemberState{{APIServerID: "b", ConfigHash: "other", FIPS: &yes, ClusterID: "c1"}, {APIServerID: "a", ConfigHash: cfg.Hash, FIPS: &yes}},
		Totals:  []cluster.KeyTotal{{Key: cluster.Key{Provider: "aesgcm", Key: "key1", Check: check}, Writes: 7, FirstSeen: first}},
		Ledger:  &keyledger.Ledger{Entries: []keyledger.Entry{{Provider: "aesgcm", Name: "old", Check: "oldcheck", Retired: &keyledger.Event{At: first}}}},
	}
	st := Build(in)
	if st.ObservedBy != "a" || st.ClusterID != "c1" || st.FIPS != "on" || st.ConfigHash != cfg.Hash || st.Totals.Objects != 4 || st.Totals.Plaintext != 1 {
		t.Errorf("status %+v", st)
	}
	if len(st.APIServers) != 2 || st.APIServers[0].ID != "a" || !st.APIServers[0].Agrees || st.APIServers[1].Agrees || st.APIServers[1].FIPS != "on" {
		t.Errorf("apiservers %+v", st.APIServers)
	}
	r := st.Resources[0]
	if r.WriteKey != (v1alpha1.KeyRef{Provider: "aesgcm", Name: "key1", Fingerprint: check}) || len(r.ReadKeys) != 2 || r.Revision != 42 || !r.InventoryTime.Time.Equal(taken) {
		t.Errorf("resource %+v", r)
	}
	keys := map[string]v1alpha1.StoredKey{}
	for _, k := range r.Keys {
		keys[k.Provider+"/"+k.Name] = k
	}
	w := keys["aesgcm/key1"]
	if !w.Current || !w.InConfiguration || w.Fingerprint != check || w.Writes != 7 || w.WriteBudget != AESGCMWriteBudget ||
		w.FirstUse == nil || !w.FirstUse.Time.Equal(first) || w.Age == nil || w.Age.Duration != 90*time.Minute {
		t.Errorf("write key %+v", w)
	}
	if o := keys["aesgcm/old"]; o.InConfiguration || o.Current || o.Fingerprint != "oldcheck" || o.Retired == nil || o.Unreadable != 1 {
		t.Errorf("retired key %+v", o)
	}
	if p := keys["identity/"]; p.Objects != 1 || p.Current || p.WriteBudget != 0 {
		t.Errorf("plaintext %+v", p)
	}
	joined := strings.Join(st.Attention, "; ")
	for _, want := range []string{"secrets: 1 objects stored in plaintext", "secrets: 1 objects the configuration cannot read", "apiserver b runs configuration other"} {
		if !strings.Contains(joined, want) {
			t.Errorf("attention %q lacks %q", joined, want)
		}
	}
	raw, _ := json.Marshal(st)
	if strings.Contains(string(raw), secret1) || strings.Contains(string(raw), "0123456789abcdef") {
		t.Fatal("the state holds key material")
	}
	// Equal inputs, equal states: a publisher that finds it stored writes nothing.
	if again, _ := json.Marshal(Build(in)); string(again) != string(raw) {
		t.Error("two builds of the same input differ")
	}
}

type fakePublisher struct {
	stored *v1alpha1.EncryptionStateStatus
	calls  int
}

func (p *fakePublisher) Publish(_ context.Context, st v1alpha1.EncryptionStateStatus) (bool, error) {
	p.calls++
	if p.stored != nil && p.stored.ObservedBy == st.ObservedBy && p.stored.Totals == st.Totals {
		return false, nil
	}
	p.stored = &st
	return true, nil
}

// Only a leader publishes, and only a change; a follower that leads again compares
// with what is stored.
func TestKeeperPublishesChangesWhileLeading(t *testing.T) {
	var c clock.WithTicker = testingclock.NewFakeClock(time.Now())
	leading, objects := false, int64(1)
	p := &fakePublisher{}
	k := NewKeeper(KeeperOptions{Publisher: p, Clock: c, Leading: func() bool { return leading }, Input: func() Input {
		return Input{ObservedBy: "a", Inventory: &migrate.Inventory{Resources: []migrate.ResourceInventory{{Resource: "secrets", Objects: objects}}}, Config: testConfig(t)}
	}})
	ctx := context.Background()
	k.Check(ctx)
	if p.calls != 0 {
		t.Fatal("a follower published")
	}
	leading = true
	k.Check(ctx)
	k.Check(ctx)
	if p.calls != 1 || k.Stats().Writes != 1 || k.Stats().Builds != 2 {
		t.Fatalf("calls %d stats %+v: want one publish of an unchanged state", p.calls, k.Stats())
	}
	objects = 2
	k.Check(ctx)
	if p.calls != 2 || p.stored.Totals.Objects != 2 {
		t.Fatalf("a change was not published: %d calls, %+v", p.calls, p.stored)
	}
	leading = false
	k.Check(ctx)
	leading = true
	k.Check(ctx)
	if p.calls != 3 || k.Stats().Unchanged != 1 {
		t.Fatalf("leading again: %d calls, %+v; want one compare with the stored object", p.calls, k.Stats())
	}
}
