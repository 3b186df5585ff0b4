package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/errtext"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// TestIdentityBindsTheCoordinationPrefix: the first apiserver creates <prefix>/cluster
// bound to its --etcd-prefix; the others read the same id; an apiserver of another
// --etcd-prefix is refused at start, naming both prefixes and the flag to change.
func TestIdentityBindsTheCoordinationPrefix(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	first, err := EnsureIdentity(ctx, cli, defaultPrefix, "/registry/", "a", epoch)
	if err != nil || first.ClusterID == "" || first.EtcdPrefix != "/registry" {
		t.Fatalf("created identity %+v, %v", first, err)
	}
	again, err := EnsureIdentity(ctx, cli, defaultPrefix, "/registry", "b", epoch.Add(time.Minute))
	if err != nil || again != first {
		t.Fatalf("second EnsureIdentity = %+v, %v; want the first %+v", again, err, first)
	}
	read, err := readIdentity(ctx, cli, defaultPrefix, 0)
	if err != nil || read == nil || *read != first {
		t.Fatalf("ReadIdentity = %+v, %v", read, err)
	}

	_, err = EnsureIdentity(ctx, cli, defaultPrefix, "/other", "c", epoch)
	for _, want := range []string{`"/registry"`, `"/other"`, "--coordination-prefix", first.ClusterID, coordination.Identity(defaultPrefix)} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("identity bound to another --etcd-prefix: error %v; want it to name %s", err, want)
		}
	}
	// The node refuses to start.
	node, err := New(Options{Client: cli, ID: "c", ResourcePrefix: "/other"})
	if err != nil {
		t.Fatal(err)
	}
	if err := node.Start(ctx); err == nil || !strings.Contains(err.Error(), `--etcd-prefix "/other"`) {
		t.Fatalf("Start with another --etcd-prefix: %v", err)
	}

	if _, err := cli.Put(ctx, coordination.Identity("/damaged"), "{}"); err != nil {
		t.Fatal(err)
	}
	if _, err := EnsureIdentity(ctx, cli, "/damaged", "/registry", "a", epoch); err == nil || !strings.Contains(err.Error(), "does not hold a cluster identity") {
		t.Fatalf("damaged identity: %v", err)
	}
}

// TestUnknownMembersHoldPromotionsButNotReadiness: records under the members prefix that
// are not live members of this cluster — a leftover without a lease, a record of
// another cluster, one under another apiserver's key, one that does not parse, one
// without a cluster id — are kept apart with their reason. They hold a's promotion of
// k2 (and its KMS key ids), never make a unready although they write with a key a cannot
// read, and are listed by ReadSnapshot and the status document. Deleted, they are gone.
func TestUnknownMembersHoldPromotionsButNotReadiness(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	a := startMember(t, cli, "a", secretsConfig("k1"))
	clusterID := a.node.Status().ClusterID
	if clusterID == "" {
		t.Fatal("no cluster id in a's status")
	}
	eventually(t, "a publishes its cluster id", func() bool {
		resp, err := cli.Get(ctx, memberKey(defaultPrefix, "a"))
		if err != nil || len(resp.Kvs) != 1 {
			return false
		}
		st, err := ParseMemberState(resp.Kvs[0].Value)
		return err == nil && st.ClusterID == clusterID
	})

	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	k9 := Key{Provider: "aesgcm", Key: "k9"}
	record := func(id, cluster string) string {
		st := MemberState{APIServerID: id, ClusterID: cluster, Resources: []ResourceState{{Resource: "secrets", Write: k9, Read: []Key{k9}}}}
		data, err := st.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	put := func(id, value string, opts ...clientv3.OpOption) {
		t.Helper()
		if _, err := cli.Put(ctx, memberKey(defaultPrefix, id), value, opts...); err != nil {
			t.Fatal(err)
		}
	}
	put("leftover", record("leftover", clusterID))
	put("other", record("other", "ANOTHERCLUSTER"), clientv3.WithLease(lease.ID))
	put("garbage", "not json", clientv3.WithLease(lease.ID))
	put("stolen", record("a", clusterID), clientv3.WithLease(lease.ID))
	put("old", record("old", ""), clientv3.WithLease(lease.ID))
	wantReasons := map[string]string{
		"garbage":  "does not parse as a member state",
		"leftover": "has no lease",
		"old":      "carries no cluster id",
		"other":    "belongs to cluster ANOTHERCLUSTER, not to this cluster " + clusterID,
		"stolen":   `holds the state of apiserver "a" under another apiserver's key`,
	}
	checkUnknown := func(what string, got []UnknownMember) {
		t.Helper()
		if len(got) != len(wantReasons) {
			t.Fatalf("%s: unknown members %+v; want %d", what, got, len(wantReasons))
		}
		for _, u := range got {
			if want := wantReasons[u.APIServerID]; want == "" || !strings.Contains(u.Reason, want) || u.Key != memberKey(defaultPrefix, u.APIServerID) {
				t.Errorf("%s: %+v; want reason %q", what, u, want)
			}
		}
	}
	eventually(t, "a sees five unknown members", func() bool { return len(a.node.view.Unknown()) == len(wantReasons) })
	checkUnknown("view", a.node.view.Unknown())
	if ids := memberIDs(a.node.view); ids != "a" {
		t.Fatalf("members %s; want a alone", ids)
	}
	if missing := a.node.MissingKeys(); len(missing) != 0 {
		t.Fatalf("unknown members count against readiness: %v", missing)
	}
	if err := a.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("a not ready with unknown members only: %v", err)
	}
	st := a.node.Status()
	checkUnknown("status", st.UnknownMembers)
	snap, err := ReadSnapshot(ctx, cli, defaultPrefix)
	if err != nil {
		t.Fatal(err)
	}
	checkUnknown("snapshot", snap.UnknownMembers)
	if len(snap.Members) != 1 || snap.Identity == nil || snap.Identity.ClusterID != clusterID {
		t.Fatalf("snapshot members %+v, identity %+v", snap.Members, snap.Identity)
	}

	// A new key is held while they exist, though no live member is missing it.
	writeFile(t, a.path, secretsConfig("k2", "k1"))
	if err := a.agent.Reload(ctx); err != nil {
		t.Fatal(err)
	}
	if p := a.writePrefix(t); p != "k8s:enc:aesgcm:v1:k1:" {
		t.Fatalf("a writes %q with unknown members present; want k1 held", p)
	}
	h := a.node.Holds()
	if len(h) != 1 || h[0].Held.Key != "k2" || len(h[0].WaitingFor) != len(wantReasons) || !slices.Contains(h[0].WaitingFor, "unknown member leftover") {
		t.Fatalf("holds %+v; want k2 waiting for the unknown members", h)
	}
	if a.node.MayWriteKeyID("vault", "h2") {
		t.Fatal("the key-id fence is open with unknown members present")
	}

	if _, err := cli.Delete(ctx, membersPrefix(defaultPrefix)+"garbage"); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Delete(ctx, memberKey(defaultPrefix, "leftover")); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Revoke(ctx, lease.ID); err != nil {
		t.Fatal(err)
	}
	eventually(t, "a promotes k2 once the unknown members are gone", func() bool { return a.writePrefix(t) == "k8s:enc:aesgcm:v1:k2:" })
	if u := a.node.view.Unknown(); len(u) != 0 {
		t.Fatalf("unknown members after deleting them: %+v", u)
	}
}

// TestMemberRecordIsBoundedNeverDropped: an over-limit record loses the refused
// reload's text first, then the KMS errors, and keeps resources and key ids; a record
// under the limit is published as it is.
func TestMemberRecordIsBoundedNeverDropped(t *testing.T) {
	k1 := Key{Provider: "aesgcm", Key: "k1"}
	base := MemberState{APIServerID: "a", ClusterID: "C", Resources: []ResourceState{{Resource: "secrets", Write: k1, Read: []Key{k1}}},
		KMS: []KMSState{{Name: "vault", Healthy: true, KeyIDHash: "sha256:1", LastError: "short"}}, LastReloadError: "short"}
	data, sent, err := encodeRecord(base, 1024)
	if want, _ := base.Marshal(); err != nil || string(data) != string(want) || sent.Reduced != nil {
		t.Fatalf("small record changed: %s (reduced %v, %v)", data, sent.Reduced, err)
	}

	big := base
	big.LastReloadError = strings.Repeat("x", 4000)
	data, sent, err = encodeRecord(big, 1024)
	if err != nil || len(data) > 1024 || !slices.Equal(sent.Reduced, []string{"lastReloadError"}) || sent.KMS[0].LastError != "short" {
		t.Fatalf("reload error: %d bytes, reduced %v, kms %+v (%v)", len(data), sent.Reduced, sent.KMS, err)
	}

	big.KMS = nil
	for i := range 8 {
		big.KMS = append(big.KMS, KMSState{Name: fmt.Sprint("p", i), KeyIDHash: "sha256:1", LastError: strings.Repeat("y", 500)})
	}
	data, sent, err = encodeRecord(big, 2048)
	if err != nil || len(data) > 2048 || !slices.Equal(sent.Reduced, []string{"lastReloadError", "kms.lastError"}) {
		t.Fatalf("kms errors: %d bytes, reduced %v (%v)", len(data), sent.Reduced, err)
	}
	var got MemberState
	if err := json.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	if len(got.Resources) != 1 || got.Resources[0].Write != k1 || len(got.KMS) != 8 || got.KMS[7].KeyIDHash != "sha256:1" ||
		!strings.Contains(got.LastReloadError, "cut") || !slices.Equal(got.Reduced, sent.Reduced) {
		t.Fatalf("reduced record lost what the others decide on: %+v", got)
	}
	if big.LastReloadError == got.LastReloadError || big.KMS[0].LastError != strings.Repeat("y", 500) {
		t.Fatal("encodeRecord changed its argument")
	}

	// Too large even without error texts: published as it is, etcd decides.
	huge := MemberState{APIServerID: "a", Resources: []ResourceState{{Resource: strings.Repeat("r", 2000), Write: k1}}}
	if data, sent, err = encodeRecord(huge, 1024); err != nil || len(data) < 2000 || sent.Reduced != nil {
		t.Fatalf("record of essential content: %d bytes, reduced %v (%v)", len(data), sent.Reduced, err)
	}
}

// TestBrokenFileErrorReachesTheRecordBounded: a broken file of tens of thousands of
// errors is refused, and the refused reload's error reaches the member record cut to
// errtext.MaxPublished: the record stays small and a stays a member.
func TestBrokenFileErrorReachesTheRecordBounded(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	a := startMember(t, cli, "a", secretsConfig("k1"))
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n")
	for i := range 1500 {
		fmt.Fprintf(&b, "- resources: [r%d]\n  providers:\n  - aesgcm:\n      keys:\n      - name: k\n        secret: not-base64-%d\n", i, i)
	}
	if b.Len() < 80<<10 {
		t.Fatalf("broken file of %d bytes; want at least 80 KiB", b.Len())
	}
	writeFile(t, a.path, b.String())
	if err := a.agent.Reload(ctx); err == nil {
		t.Fatal("the broken file was accepted")
	}
	var st MemberState
	eventually(t, "a publishes the refused reload", func() bool {
		resp, err := cli.Get(ctx, memberKey(defaultPrefix, "a"))
		if err != nil || len(resp.Kvs) != 1 {
			return false
		}
		st, err = ParseMemberState(resp.Kvs[0].Value)
		return err == nil && st.LastReloadError != "" && resp.Kvs[0].Lease != 0
	})
	// errtext's note of what was left out follows the cut text.
	if n := len(st.LastReloadError); n > errtext.MaxPublished+64 {
		t.Fatalf("published reload error of %d bytes; want at most %d and a note", n, errtext.MaxPublished)
	}
	if !strings.Contains(st.LastReloadError, "more ") {
		t.Errorf("published reload error does not say what was left out: %q", st.LastReloadError)
	}
}

// TestReadinessFailsWhenPublishingFailsLongerThanTheLease: a member that cannot publish
// is still ready within one lease TTL (a blip), and not ready, saying why, past it; a
// successful publish makes it ready again.
func TestReadinessFailsWhenPublishingFailsLongerThanTheLease(t *testing.T) {
	srv := etcdtest.Start(t)
	cli, err := srv.NewClient()
	if err != nil {
		t.Fatal(err)
	}
	clock := testingclock.NewFakeClock(epoch)
	a := startMember(t, cli, "a", secretsConfig("k1"), shortLease, func(o *Options) { o.Clock = clock })
	eventually(t, "a ready", func() bool { return a.node.ReadyzCheck().Check(nil) == nil })
	ctx := context.Background()

	a.node.mu.Lock()
	a.node.publishErr, a.node.publishFailingSince = "etcdserver: request is too large", clock.Now()
	a.node.mu.Unlock()
	clock.Step(2 * time.Second)
	if err := a.node.ReadyzCheck().Check(nil); err != nil {
		t.Fatalf("not ready within the lease TTL: %v", err)
	}
	clock.Step(time.Second)
	err = a.node.ReadyzCheck().Check(nil)
	for _, want := range []string{"has not been able to publish its encryption state", "3s", "2s lease", "request is too large"} {
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("readiness past the lease: %v; want %q", err, want)
		}
	}
	a.node.publish(ctx, true)
	// The clock moved 3 s, longer than the lease, which may also be taken for a pause:
	// then readiness waits until the view shows the record just published.
	eventually(t, "ready after a successful publish", func() bool { return a.node.ReadyzCheck().Check(nil) == nil })

	// A real failure: the client is closed.
	if err := cli.Close(); err != nil {
		t.Fatal(err)
	}
	a.node.publish(ctx, true)
	clock.Step(3 * time.Second)
	if err := a.node.ReadyzCheck().Check(nil); err == nil || !strings.Contains(err.Error(), "has not been able to publish") {
		t.Fatalf("readiness with a closed client: %v", err)
	}
}

// TestMemberRecordSaysWhatItMigrates: a member publishes the resources it migrates as
// leader (none with --storage-migration off), so `rekey rotate --wait` can refuse a
// rotation nobody would migrate; a record of an older version, without the field,
// still decodes and does not say.
func TestMemberRecordSaysWhatItMigrates(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	startMember(t, cli, "migrating", secretsConfig("k1"), func(o *Options) { o.MigratesResources = []string{"secrets", "deployments.apps"} })
	startMember(t, cli, "inventory-only", secretsConfig("k1"))
	startMember(t, cli, "apps-wildcard", secretsConfig("k1"), func(o *Options) { o.MigratesResources = []string{"*.apps"} })
	published := func(id string) MemberState {
		t.Helper()
		var st MemberState
		eventually(t, id+" published", func() bool {
			resp, err := cli.Get(context.Background(), memberKey(defaultPrefix, id))
			if err != nil || len(resp.Kvs) != 1 {
				return false
			}
			st, err = ParseMemberState(resp.Kvs[0].Value)
			return err == nil && st.StorageMigration != nil
		})
		return st
	}
	m := published("migrating")
	for res, want := range map[string]bool{"secrets": true, "deployments.apps": true, "configmaps": false} {
		if got, known := m.Migrates(res); got != want || !known {
			t.Errorf("migrating member: Migrates(%s) = %v, %v; want %v, true", res, got, known, want)
		}
	}
	w := published("apps-wildcard")
	for res, want := range map[string]bool{"deployments.apps": true, "statefulsets.apps": true, "secrets": false} {
		if got, known := w.Migrates(res); got != want || !known {
			t.Errorf("member migrating *.apps: Migrates(%s) = %v, %v; want %v, true", res, got, known, want)
		}
	}
	if got, known := published("inventory-only").Migrates("secrets"); got || !known {
		t.Errorf("member with --storage-migration off: Migrates(secrets) = %v, %v; want false, true", got, known)
	}
	old, err := ParseMemberState([]byte(`{"apiserverID":"old","configHash":"sha256:00","resources":[{"resource":"secrets","write":{"provider":"identity"},"read":[{"provider":"identity"}]}],"publishedAt":"2026-01-01T00:00:00Z"}`))
	if err != nil {
		t.Fatalf("a record without storageMigration: %v", err)
	}
	if got, known := old.Migrates("secrets"); got || known {
		t.Errorf("older record: Migrates(secrets) = %v, %v; want false, false (it does not say)", got, known)
	}
}
