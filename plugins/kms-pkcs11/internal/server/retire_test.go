package server_test

import (
	"context"
	"errors"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/inuse"
	"github.com/rekey-io/rekey/plugins/kms-pkcs11/internal/softhsmtest"
)

// TestRetireRefusedWhileNeeded: retiring version 1 is refused while a stored object,
// a live apiserver's member record or the key ledger within the backup retention
// needs its key id, each named; once the object is rewritten under version 2, the
// member writes under version 2 and the retention has passed, it is allowed.
func TestRetireRefusedWhileNeeded(t *testing.T) {
	h := softhsmtest.New(t)
	adm := admin(t, h)
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	p := startPlugin(t, h, h.PIN)
	etcd := etcdtest.Start(t)
	cli := etcd.Client(t)
	ctx := context.Background()
	const prefix = "/rekey"
	v1, v2 := inuse.HashKeyID("kek:v1"), inuse.HashKeyID("kek:v2")

	// A Secret written by rekey's transformer under version 1.
	our, _ := ours(t, p, "hsm")
	if _, err := cli.Put(ctx, "/registry/secrets/ns/s1", string(write(t, our, "secret-1"))); err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, "/registry/configmaps/ns/plain", "not encrypted"); err != nil {
		t.Fatal(err)
	}
	// A live apiserver writing under version 1, publishing a 0s retention.
	lease, err := cli.Grant(ctx, 60)
	if err != nil {
		t.Fatal(err)
	}
	putMember := func(keyIDHash string) {
		t.Helper()
		rec, err := cluster.MemberState{APIServerID: "apiserver-1", ConfigHash: "sha256:00", BackupRetention: "0s", PublishedAt: time.Now(),
			KMS: []cluster.KMSState{{Name: "hsm", Healthy: true, KeyIDHash: keyIDHash, ReportedKeyIDHash: keyIDHash}}}.Marshal()
		if err != nil {
			t.Fatal(err)
		}
		if _, err := cli.Put(ctx, coordination.Member(prefix, "apiserver-1"), string(rec), clientv3.WithLease(lease.ID)); err != nil {
			t.Fatal(err)
		}
	}
	putMember(v1)
	// The key ledger: version 1 retired an hour ago.
	now := time.Now()
	retired := keyledger.Event{At: now.Add(-time.Hour), Revision: 2}
	store := keyledger.Store{Client: cli, Key: keyledger.Key(prefix)}
	if _, err := store.Update(ctx, func(l *keyledger.Ledger, rev int64) bool {
		l.Entries = append(l.Entries,
			keyledger.Entry{Provider: transformers.ProviderKMSv2, Name: "hsm", KeyIDHash: v1, Prefix: "k8s:enc:kms:v2:hsm:", FirstUse: keyledger.Event{At: now.Add(-48 * time.Hour), Revision: 1}, LastUse: retired, Retired: &retired},
			keyledger.Entry{Provider: transformers.ProviderKMSv2, Name: "hsm", KeyIDHash: v2, Prefix: "k8s:enc:kms:v2:hsm:", FirstUse: retired, LastUse: retired})
		return true
	}); err != nil {
		t.Fatal(err)
	}
	opts := inuse.Options{Client: cli, EtcdPrefix: "/registry", CoordinationPrefix: prefix, Retention: 24 * time.Hour, RetentionSet: true, Now: now}
	check := func(o inuse.Options) error { return inuse.Check(ctx, o, "retire", "version 1", "kek:v1") }

	err = check(opts)
	var r *inuse.Refused
	if !errors.As(err, &r) || !errors.Is(err, guard.ErrRefused) {
		t.Fatalf("retire with everything needing version 1: %v", err)
	}
	if len(r.Stored) != 1 || r.Stored[0].Dir != "/registry/secrets/" || r.Stored[0].Objects != 1 || r.Stored[0].Provider != "hsm" {
		t.Fatalf("stored: %+v", r.Stored)
	}
	if len(r.Members) != 1 || !strings.Contains(r.Members[0], "apiserver-1") {
		t.Fatalf("members: %v", r.Members)
	}
	if len(r.Holds) != 1 || r.Holds[0].Key.KeyIDHash != v1 {
		t.Fatalf("holds: %+v", r.Holds)
	}
	for _, want := range []string{"refusing to retire version 1 (key id " + v1 + ")", "rekey inventory", "--backup-retention", "--unsafe-allow-dropping-keys-in-use", "a snapshot up to 1d old may hold values under kms hsm (key id " + v1 + ")"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("the refusal does not say %q:\n%v", want, err)
		}
	}
	t.Logf("refusal:\n%v", err)
	if strings.Contains(err.Error(), "kek:v1") {
		t.Errorf("the refusal names the key id in clear instead of its hash:\n%v", err)
	}

	// Version 2 is what the ledger shows written and not retired: a snapshot taken now
	// may hold values under it.
	if err := inuse.Check(ctx, opts, "retire", "version 2", "kek:v2"); !errors.Is(err, guard.ErrRefused) {
		t.Fatalf("retire of the version the ledger shows in use: %v", err)
	}

	// Migrate: the Secret rewritten under version 2 (upstream's transformer loaded after
	// the rotation writes under it at once).
	if _, err := adm.Rotate(time.Now()); err != nil {
		t.Fatal(err)
	}
	up := upstream(t, p, "hsm")
	if _, err := cli.Put(ctx, "/registry/secrets/ns/s1", string(write(t, up, "secret-1"))); err != nil {
		t.Fatal(err)
	}
	putMember(v2)
	err = check(opts)
	if !errors.As(err, &r) || len(r.Stored) != 0 || len(r.Members) != 0 || len(r.Holds) != 1 {
		t.Fatalf("after migration, only the retention should hold version 1: %v", err)
	}
	// A member publishing a longer retention than the flag is honoured.
	opts.Retention = 30 * time.Minute
	if err := check(opts); err != nil {
		t.Fatalf("retention of 30m, version 1 retired 1h ago: %v", err)
	}
	if err := adm.Retire(1, now); err != nil {
		t.Fatal(err)
	}
}
