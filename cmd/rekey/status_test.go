package main

import (
	"context"
	"encoding/json"
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// TestStatusVerdictAndExitCode publishes member states as apiservers would and checks
// the table, the JSON and that only a converged cluster exits 0.
func TestStatusVerdictAndExitCode(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	k := func(name string) cluster.Key {
		return cluster.Key{Provider: "aesgcm", Key: name, Check: "check-" + name}
	}
	publish := func(m cluster.MemberState) {
		t.Helper()
		m.PublishedAt = time.Now()
		data, err := m.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if err := putMember(ctx, cli, m.APIServerID, string(data)); err != nil {
			t.Fatal(err)
		}
	}
	k2 := k("k2")
	publish(cluster.MemberState{APIServerID: "a", ConfigHash: "sha256:aaaaaaaaaaaaaaaaaaaa", Resources: []cluster.ResourceState{
		{Resource: "secrets", Write: k("k1"), Read: []cluster.Key{k2, k("k1")}, Held: &k2},
	}})
	publish(cluster.MemberState{APIServerID: "b", ConfigHash: "sha256:bbbbbbbbbbbbbbbbbbbb", Resources: []cluster.ResourceState{
		{Resource: "secrets", Write: k("k1"), Read: []cluster.Key{k("k1")}},
	}})
	out, err := run(t, "status", "--etcd-servers", srv.Endpoint)
	if !errors.Is(err, errNotConverged) {
		t.Fatalf("status while a holds k2: err %v, want not converged\n%s", err, out)
	}
	for _, want := range []string{"secrets=aesgcm/k1 (holding aesgcm/k2)", "secrets=aesgcm/k2,aesgcm/k1", "VERDICT promoting aesgcm/k2 for secrets on a, waiting for b"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}

	publish(cluster.MemberState{APIServerID: "a", ConfigHash: "sha256:cccc", Resources: []cluster.ResourceState{{Resource: "secrets", Write: k2, Read: []cluster.Key{k2, k("k1")}}}})
	publish(cluster.MemberState{APIServerID: "b", ConfigHash: "sha256:cccc", Resources: []cluster.ResourceState{{Resource: "secrets", Write: k2, Read: []cluster.Key{k2, k("k1")}}}})
	out, err = run(t, "status", "--etcd-servers", srv.Endpoint, "-o", "json")
	if err != nil {
		t.Fatalf("status of a converged cluster: %v\n%s", err, out)
	}
	var doc struct {
		Members []cluster.MemberState `json:"members"`
		Verdict cluster.Verdict       `json:"verdict"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if !doc.Verdict.Converged || len(doc.Members) != 2 || doc.Verdict.Summary != "converged" {
		t.Fatalf("json verdict %+v", doc.Verdict)
	}

	// A member that has seen disagreement for longer than the threshold: alarm.
	publish(cluster.MemberState{APIServerID: "b", ConfigHash: "sha256:cccc", DisagreeingSince: time.Now().Add(-5 * time.Minute),
		Resources: []cluster.ResourceState{{Resource: "secrets", Write: k2, Read: []cluster.Key{k2, k("k1")}}}})
	out, err = run(t, "status", "--etcd-servers", srv.Endpoint)
	if !errors.Is(err, errNotConverged) || !strings.Contains(out, "VERDICT alarm:") {
		t.Fatalf("status with an old disagreement: %v\n%s", err, out)
	}
}

// putMember publishes value as apiserver id's member record the way an apiserver does:
// under a lease (a record without one is a leftover, not a member).
func putMember(ctx context.Context, cli *clientv3.Client, id, value string) error {
	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		return err
	}
	_, err = cli.Put(ctx, coordination.Member(coordination.DefaultPrefix, id), value, clientv3.WithLease(lease.ID))
	return err
}

// TestStatusListsUnknownMembers: records that are not live members of the cluster — a
// leftover without a lease, a record of another cluster — are listed apart with their
// reason, in the table and in the JSON, and do not count as members.
func TestStatusListsUnknownMembers(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	id, err := cluster.EnsureIdentity(ctx, cli, coordination.DefaultPrefix, "/registry", "a", time.Now())
	if err != nil {
		t.Fatal(err)
	}
	k1 := cluster.Key{Provider: "aesgcm", Key: "k1"}
	record := func(id, clusterID string) string {
		data, err := cluster.MemberState{APIServerID: id, ClusterID: clusterID, PublishedAt: time.Now(),
			Resources: []cluster.ResourceState{{Resource: "secrets", Write: k1, Read: []cluster.Key{k1}}}}.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		return string(data)
	}
	if err := putMember(ctx, cli, "a", record("a", id.ClusterID)); err != nil {
		t.Fatal(err)
	}
	if err := putMember(ctx, cli, "foreign", record("foreign", "ANOTHER")); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, coordination.Member(coordination.DefaultPrefix, "leftover"), record("leftover", id.ClusterID)); err != nil {
		t.Fatal(err)
	}
	out, err := run(t, "status", "--etcd-servers", srv.Endpoint)
	if err != nil {
		t.Fatalf("status: %v\n%s", err, out)
	}
	for _, want := range []string{"UNKNOWN MEMBERS", "/rekey/members/foreign: belongs to cluster ANOTHER", "/rekey/members/leftover: has no lease", "VERDICT converged"} {
		if !strings.Contains(out, want) {
			t.Errorf("table lacks %q:\n%s", want, out)
		}
	}
	out, err = run(t, "status", "--etcd-servers", srv.Endpoint, "-o", "json")
	if err != nil {
		t.Fatalf("status -o json: %v\n%s", err, out)
	}
	var doc struct {
		Identity       *cluster.Identity       `json:"identity"`
		Members        []cluster.MemberState   `json:"members"`
		UnknownMembers []cluster.UnknownMember `json:"unknownMembers"`
	}
	if err := json.Unmarshal([]byte(out), &doc); err != nil {
		t.Fatalf("%v\n%s", err, out)
	}
	if len(doc.Members) != 1 || len(doc.UnknownMembers) != 2 || doc.UnknownMembers[1].APIServerID != "leftover" ||
		!strings.Contains(doc.UnknownMembers[1].Reason, "no lease") || doc.Identity == nil || doc.Identity.ClusterID != id.ClusterID {
		t.Fatalf("json: %s", out)
	}
}
