package cluster

import (
	"context"
	"slices"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// TestMemberRecordPublishesBackupRetention: a member publishes its --backup-retention
// ("0s" when off: known), LargestRetention names who publishes the largest, and a record
// of an older version, without the field, is unknown.
func TestMemberRecordPublishesBackupRetention(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	startMember(t, cli, "month", secretsConfig("k1"), func(o *Options) { o.BackupRetention = 720 * time.Hour })
	startMember(t, cli, "off", secretsConfig("k1"))
	published := func(id string) MemberState {
		t.Helper()
		var st MemberState
		eventually(t, id+" published", func() bool {
			resp, err := cli.Get(context.Background(), memberKey(defaultPrefix, id))
			if err != nil || len(resp.Kvs) != 1 {
				return false
			}
			st, err = ParseMemberState(resp.Kvs[0].Value)
			return err == nil
		})
		return st
	}
	month, off := published("month"), published("off")
	if d, known := month.PublishedRetention(); d != 720*time.Hour || !known {
		t.Errorf("month: %v, %v; want 720h, known", d, known)
	}
	if d, known := off.PublishedRetention(); d != 0 || !known || off.BackupRetention != "0s" {
		t.Errorf("off: %v, %v (%q); want 0, known", d, known, off.BackupRetention)
	}
	old, err := ParseMemberState([]byte(`{"apiserverID":"old","configHash":"sha256:00","resources":[],"publishedAt":"2026-01-01T00:00:00Z"}`))
	if err != nil {
		t.Fatal(err)
	}
	if _, known := old.PublishedRetention(); known {
		t.Error("a record without backupRetention must be unknown")
	}
	longest, by, unknown := LargestRetention([]MemberState{off, month, old})
	if longest != 720*time.Hour || !slices.Equal(by, []string{"month"}) || !slices.Equal(unknown, []string{"old"}) {
		t.Errorf("LargestRetention = %v by %v, unknown %v; want 720h by month, old unknown", longest, by, unknown)
	}
}
