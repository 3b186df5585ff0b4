package cluster

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

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

// TestKMSKeyIDChangeIsMigratedOnceEveryPluginReportsIt: a plugin's new key id is
// published at once (the provider's key-id hook), and the leader migrates to it only
// after every member's plugin reports it.
func TestKMSKeyIDChangeIsMigratedOnceEveryPluginReportsIt(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	var members []*member
	var keyFiles []string
	for _, id := range []string{"a", "b"} {
		m, keys := startKMSMember(t, id)
		sock := "unix://" + filepath.Join(filepath.Dir(keys), "p.sock")
		writeFile(t, m.path, "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n- resources: [secrets]\n  providers:\n  - kms:\n      apiVersion: v2\n      name: vault\n      endpoint: "+sock+"\n      timeout: 2s\n")
		log := ktesting.NewLogger(t, ktesting.NewConfig())
		node, err := New(Options{Client: cli, ID: id, ResourcePrefix: "/registry", LeaseTTL: 2 * time.Second, Logger: log})
		if err != nil {
			t.Fatal(err)
		}
		if err := node.Start(ctx); err != nil {
			t.Fatal(err)
		}
		agent, err := reload.NewAgent(ctx, reload.Options{
			Path: m.path, AutomaticReload: true, GracePeriod: time.Millisecond, Logger: log,
			WriteFence: node.WriteFence, OnChange: node.Notify, Guard: node.Guard,
			Transformers: transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{
				Registry: metrics.NewKubeRegistry(), StatusInterval: 100 * time.Millisecond, HealthyTTL: time.Nanosecond,
				OnKeyIDChange: node.NotifyKeyID,
			})},
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
	a, b := members[0], members[1]
	eventually(t, "a sees b", func() bool { return memberIDs(a.node.View()) == "a,b" })
	tr := a.agent.TransformerForResource(secrets)
	for i := range 20 {
		key := fmt.Sprintf("/registry/secrets/ns/s%02d", i)
		out, err := tr.TransformToStorage(ctx, storedObject(key), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, key, string(out)); err != nil {
			t.Fatal(err)
		}
	}
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
		for _, s := range a.node.View().Members() {
			if s.APIServerID == m.id && len(s.Resources) == 1 && s.Resources[0].Write.KeyIDHash == h {
				return true
			}
		}
		return false
	}
	eventually(t, "a's new key id published", func() bool { return published(a, h2) })
	time.Sleep(1500 * time.Millisecond)
	if recorded(h2) {
		t.Fatal("migrated to the new key id before b's plugin reported it")
	}
	if st, _ := mig.State(); len(st.Plans) != 1 || st.Plans[0].State != PlanWaiting {
		t.Fatalf("plans while the plugins disagree: %+v", st.Plans)
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
