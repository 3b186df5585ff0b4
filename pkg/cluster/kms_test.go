package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2/ktesting"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
)

// kmsKeys writes a plugin keys file: the named keys, first active; secrets are shared
// by name, as plugins on different nodes sharing one KEK would see them.
func kmsKeys(t *testing.T, path string, names ...string) {
	t.Helper()
	content := "keys:\n"
	for _, n := range names {
		content += fmt.Sprintf("- name: %s\n  secret: %s\n", n, testKey("kek "+n))
	}
	writeFile(t, path, content)
}

// startKMSMember starts a member whose secrets rule is one KMS v2 provider "vault",
// served by its own plugin process (in-process server on a unix socket).
func startKMSMember(t *testing.T, id string) (*member, string) {
	t.Helper()
	dir, err := os.MkdirTemp("", "kms-"+id)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	keys := filepath.Join(dir, "keys.yaml")
	kmsKeys(t, keys, "kek1")
	sock := "unix://" + filepath.Join(dir, "p.sock")
	srv, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: sock, KeysFile: keys})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	return &member{id: id, path: filepath.Join(dir, "enc.yaml")}, keys
}

// startKMSNodes starts members a and b, each with its own plugin (keyring kek1) and a
// node; fenced wires the node's key-id fence into the KMS factory.
func startKMSNodes(t *testing.T, cli *clientv3.Client, fenced bool) ([]*member, []string) {
	t.Helper()
	ctx := context.Background()
	var members []*member
	var keyFiles []string
	for _, id := range []string{"a", "b"} {
		m, keys := startKMSMember(t, id)
		sock := "unix://" + filepath.Join(filepath.Dir(keys), "p.sock")
		writeFile(t, m.path, "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - kms:\n      apiVersion: v2\n      name: vault\n      endpoint: "+sock+"\n      timeout: 2s\n")
		log := ktesting.NewLogger(t, ktesting.NewConfig())
		node, err := New(Options{Client: cli, ID: id, ResourcePrefix: "/registry", LeaseTTL: DefaultLeaseTTL, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		if err := node.Start(ctx); err != nil {
			t.Fatal(err)
		}
		fo := kmsv2.FactoryOptions{
			Registry: metrics.NewKubeRegistry(), StatusInterval: 100 * time.Millisecond, HealthyTTL: time.Nanosecond,
			OnKeyIDChange: node.NotifyKeyID, FenceRecheckInterval: 50 * time.Millisecond,
		}
		if fenced {
			fo.MayWriteKeyID = node.MayWriteKeyID
		}
		agent, err := reload.NewAgent(ctx, reload.Options{
			Path: m.path, AutomaticReload: true, GracePeriod: time.Millisecond, Logger: log,
			WriteFence: node.WriteFence, OnChange: node.Notify, Guard: node.Guard,
			Transformers: transformers.Options{KMS: kmsv2.NewFactory(fo)},
		})
		if err != nil {
			node.Close()
			t.Fatal(err)
		}
		m.node, m.agent = node, agent
		t.Cleanup(m.stop)
		eventually(t, id+"'s plugin reports a key id", func() bool {
			k := agent.OwnStatus().KMSProviders
			return len(k) == 1 && k[0].KeyIDHash != ""
		})
		node.Attach(agent)
		members, keyFiles = append(members, m), append(keyFiles, keys)
	}
	eventually(t, "a sees b", func() bool { return memberIDs(members[0].node.view) == "a,b" })
	return members, keyFiles
}

// TestKMSKeyIDFenceHoldsANewKeyIDUntilEveryPluginReportsIt: a's plugin gets kek2 first.
// a keeps writing under kek1 (b's plugin cannot decrypt kek2), publishes that it holds
// kek2 and that its plugin reports it, and every value it writes stays readable on b;
// once b's plugin reports kek2, both write under kek2.
func TestKMSKeyIDFenceHoldsANewKeyIDUntilEveryPluginReportsIt(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	members, keyFiles := startKMSNodes(t, cli, true)
	a, b := members[0], members[1]
	h1, h2 := state.KeyIDHash("kek1"), state.KeyIDHash("kek2")
	kmsOf := func(m *member) transformers.KMSStatus { return m.agent.OwnStatus().KMSProviders[0] }
	published := func(of *member) KMSState {
		for _, s := range b.node.view.Members() {
			if s.APIServerID == of.id && len(s.KMS) == 1 {
				return s.KMS[0]
			}
		}
		return KMSState{}
	}
	// A value written by from, read by to.
	roundTrip := func(from, to *member, i int) error {
		key := fmt.Sprintf("/registry/secrets/ns/r%03d", i)
		out, err := from.agent.TransformerForResource(secrets).TransformToStorage(ctx, []byte(key), value.DefaultContext(key))
		if err != nil {
			return fmt.Errorf("write on %s: %w", from.id, err)
		}
		got, _, err := to.agent.TransformerForResource(secrets).TransformFromStorage(ctx, out, value.DefaultContext(key))
		if err != nil {
			return fmt.Errorf("read on %s of a value written by %s: %w", to.id, from.id, err)
		}
		if string(got) != key {
			return fmt.Errorf("read on %s: %q, want %q", to.id, got, key)
		}
		return nil
	}

	kmsKeys(t, keyFiles[0], "kek2", "kek1")
	eventually(t, "a publishes that its plugin reports kek2 and that it holds it", func() bool {
		p := published(a)
		return p.ReportedKeyIDHash == h2 && p.HeldKeyIDHash == h2 && p.KeyIDHash == h1 && !p.HeldSince.IsZero()
	})
	// Several Status intervals (100 ms) with kek2 reported: a keeps writing under kek1.
	for i := range 20 {
		if err := roundTrip(a, b, i); err != nil {
			t.Fatal(err)
		}
		time.Sleep(25 * time.Millisecond)
	}
	if st := kmsOf(a); st.KeyIDHash != h1 || st.HeldKeyIDHash != h2 || !st.Healthy {
		t.Fatalf("a while b's plugin does not know kek2: writes under %s, holds %q, healthy %t; want %s, %s, true", st.KeyIDHash, st.HeldKeyIDHash, st.Healthy, h1, h2)
	}
	holds := a.node.Holds()
	if len(holds) != 1 || holds[0].Held.KeyIDHash != h2 || holds[0].Writing.KeyIDHash != h1 || strings.Join(holds[0].WaitingFor, ",") != "b" {
		t.Fatalf("a's holds: %+v, want kek2 held, kek1 writing, waiting for b", holds)
	}
	if v := a.node.Status().Verdict; v.Converged || !strings.Contains(v.Summary, "promoting kms/vault "+h2) || !strings.Contains(v.Summary, "waiting for b") {
		t.Fatalf("verdict while a holds kek2: %+v", v)
	}

	kmsKeys(t, keyFiles[1], "kek2", "kek1")
	eventually(t, "both write under kek2", func() bool {
		return kmsOf(a).KeyIDHash == h2 && kmsOf(b).KeyIDHash == h2 && kmsOf(a).HeldKeyIDHash == ""
	})
	for i := range 5 {
		if err := roundTrip(a, b, 100+i); err != nil {
			t.Fatal(err)
		}
		if err := roundTrip(b, a, 200+i); err != nil {
			t.Fatal(err)
		}
	}
	if h := a.node.Holds(); len(h) != 0 {
		t.Fatalf("a still holds after the fence opened: %+v", h)
	}
}

// TestKMSKeyIDChangeIsMigratedOnceEveryPluginReportsIt: a plugin's new key id is
// published at once (the provider's key-id hook), and the leader migrates to it only
// after every member's plugin reports it.
func TestKMSKeyIDChangeIsMigratedOnceEveryPluginReportsIt(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	members, keyFiles := startKMSNodes(t, cli, false)
	a, b := members[0], members[1]
	eventually(t, "a sees b", func() bool { return memberIDs(a.node.view) == "a,b" })
	storeSecrets(t, cli, a, 20, "/registry/secrets/ns/s%02d")
	mctx, mcancel := context.WithCancel(ctx)
	defer mcancel()
	mig, done := startMigrator(t, mctx, cli, a, nil)
	h1, h2 := state.KeyIDHash("kek1"), state.KeyIDHash("kek2")
	recorded := func(h string) bool {
		st, _ := mig.State()
		r := st.Records["secrets"]
		return r.Verified && r.Target.KeyIDHash == h
	}
	eventually(t, "the first migration records kek1", func() bool { return recorded(h1) })

	// a's plugin rotates: a publishes the new key id; b's plugin has not: no migration.
	kmsKeys(t, keyFiles[0], "kek2", "kek1")
	published := func(m *member, h string) bool {
		for _, s := range a.node.view.Members() {
			if s.APIServerID == m.id && len(s.Resources) == 1 && s.Resources[0].Write.KeyIDHash == h {
				return true
			}
		}
		return false
	}
	eventually(t, "a's new key id published", func() bool { return published(a, h2) })
	eventually(t, "the leader sees the plugins disagree", func() bool {
		st, _ := mig.State()
		return len(st.Plans) == 1 && st.Plans[0].State == PlanWaiting
	})
	if recorded(h2) {
		t.Fatal("migrated to the new key id before b's plugin reported it")
	}

	kmsKeys(t, keyFiles[1], "kek2", "kek1")
	eventually(t, "b's new key id published", func() bool { return published(b, h2) })
	eventually(t, "migrated to kek2", func() bool { return recorded(h2) })
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromRules(b.agent, b.agent.Rules),
		Resources: []migrate.Resource{migrate.ResourceFor("/registry", secrets)}, DecryptCheck: true})
	if err != nil {
		t.Fatal(err)
	}
	ri := inv.Find("secrets")
	if ri.Objects != 20 || ri.Stale != 0 || ri.Unreadable != 0 {
		t.Fatalf("after the migration, b's inventory: %d objects, %d stale, %d unreadable", ri.Objects, ri.Stale, ri.Unreadable)
	}
	mcancel()
	<-done
}
