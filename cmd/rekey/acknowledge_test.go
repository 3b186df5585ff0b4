package main

import (
	"context"
	"errors"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// TestAcknowledgeUnreadableFlags drives rekey inventory and rekey migrate's
// acknowledgement flags: an object written with a key no configuration has keeps the
// migration unverified until it is acknowledged.
func TestAcknowledgeUnreadableFlags(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	oldCfg := writeConfig(t, "old.yaml", "key1")
	goneCfg := writeConfig(t, "gone.yaml", "key9")
	newCfg := writeConfig(t, "new.yaml", "key2", "key1")
	seedObjects(t, cli, oldCfg, 5)
	seedResource(t, cli, goneCfg, "secrets", "lost-ns", 1)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	migrateArgs := append([]string{"migrate", "--encryption-provider-config", newCfg, "--progress", "none"}, etcd...)

	if out, err := run(t, migrateArgs...); !errors.Is(err, migrate.ErrNotFinished) || !strings.Contains(err.Error(), "--acknowledge-unreadable") {
		t.Fatalf("migrate with an unreadable object: %v\n%s", err, out)
	}

	out, err := run(t, append([]string{"inventory", "--encryption-provider-config", newCfg, "--decrypt-check"}, etcd...)...)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{"lost-ns", "o0000", "k8s:enc:aesgcm:v1:key9:", migrate.ClassUnknownKey, "rekey migrate --acknowledge-unreadable"} {
		if !strings.Contains(out, want) {
			t.Fatalf("inventory does not list %q:\n%s", want, out)
		}
	}

	ack := append([]string{"migrate", "--encryption-provider-config", newCfg}, etcd...)
	if _, err := run(t, append(ack, "--acknowledge-unreadable", "secrets/lost-ns/o0000")...); err == nil || !strings.Contains(err.Error(), "--reason") {
		t.Fatalf("acknowledging without --reason: %v", err)
	}
	if _, err := run(t, append(ack, "--acknowledge-unreadable", "secrets/ns0/obj-000000", "--reason", "x")...); !errors.Is(err, migrate.ErrReadable) {
		t.Fatalf("acknowledging a readable object: %v", err)
	}
	if _, err := run(t, append(ack, "--acknowledge-unreadable", "secrets", "--reason", "x")...); err == nil || !strings.Contains(err.Error(), "<resource>/<namespace>/<name>") {
		t.Fatalf("acknowledging a malformed name: %v", err)
	}
	out, err = run(t, append(ack, "--acknowledge-unreadable", "secrets/lost-ns/o0000", "--reason", "the namespace was restored from a backup", "--apiserver-id", "ops-1")...)
	if err != nil || !strings.Contains(out, "acknowledged secrets/lost-ns/o0000 ("+migrate.ClassUnknownKey) {
		t.Fatalf("acknowledge: %v\n%s", err, out)
	}

	list := append([]string{"migrate", "--list-acknowledged"}, etcd...)
	out, err = run(t, list...)
	if err != nil || !strings.Contains(out, "lost-ns") || !strings.Contains(out, "ops-1") || !strings.Contains(out, "restored from a backup") {
		t.Fatalf("list: %v\n%s", err, out)
	}

	out, err = run(t, migrateArgs...)
	if err != nil || !strings.Contains(out, "verified except 1 acknowledged") {
		t.Fatalf("migrate with the object acknowledged: %v\n%s", err, out)
	}

	out, err = run(t, append([]string{"migrate", "--remove-acknowledgement", "secrets/lost-ns/o0000"}, etcd...)...)
	if err != nil || !strings.Contains(out, "removed the acknowledgement of secrets/lost-ns/o0000") {
		t.Fatalf("remove: %v\n%s", err, out)
	}
	if out, err := run(t, list...); err != nil || !strings.Contains(out, "no unreadable object is acknowledged") {
		t.Fatalf("list after remove: %v\n%s", err, out)
	}
	if _, err := run(t, migrateArgs...); !errors.Is(err, migrate.ErrNotFinished) {
		t.Fatalf("migrate after the acknowledgement was removed: %v", err)
	}

	// Acknowledged again, then the object is rewritten: the acknowledgement is void, and
	// listing deletes it, saying so.
	if _, err := run(t, append(ack, "--acknowledge-unreadable", "secrets/lost-ns/o0000", "--reason", "x")...); err != nil {
		t.Fatal(err)
	}
	seedResource(t, cli, goneCfg, "secrets", "lost-ns", 1)
	out, err = run(t, list...)
	if err != nil || !strings.Contains(out, "no unreadable object is acknowledged") ||
		!strings.Contains(out, "deleted the void acknowledgement of secrets/lost-ns/o0000: the object was rewritten or deleted") {
		t.Fatalf("list after the acknowledged object was rewritten: %v\n%s", err, out)
	}
	if resp, err := cli.Get(context.Background(), coordination.AcknowledgedPrefix(coordination.DefaultPrefix), clientv3.WithPrefix()); err != nil || len(resp.Kvs) != 0 {
		t.Fatalf("acknowledgements left in etcd: %v, %v", resp, err)
	}
}

// seedObjects stores n secrets encrypted with the configuration at cfgPath whose
// plaintext is a Kubernetes object, so a migration rewrites them.
func seedObjects(t *testing.T, cli *clientv3.Client, cfgPath string, n int) {
	t.Helper()
	set := loadSet(t, cfgPath)
	enctest.WriteObjects(t, cli, set, schema.GroupResource{Resource: "secrets"}, "/registry/secrets/", n)
}
