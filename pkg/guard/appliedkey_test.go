package guard

import (
	"context"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/coordination"
)

// TestEtcdAppliedStateFallsBackToTheOldKey: the applied state moved under the
// coordination prefix; a state saved at the old key (AppliedStatePrefix + id) by an
// older version is still read, so an upgrade keeps its start-up check, and the next
// Save writes the new key, which wins from then on.
func TestEtcdAppliedStateFallsBackToTheOldKey(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	old := EtcdAppliedState{Client: cli, Key: AppliedStatePrefix + "a"}
	if err := old.Save(ctx, &AppliedState{Version: AppliedStateVersion, ConfigHash: "sha256:old"}); err != nil {
		t.Fatal(err)
	}
	state := EtcdAppliedState{Client: cli, Key: coordination.AppliedState("/rekey-kube", "a"), Fallback: AppliedStatePrefix + "a"}
	got, err := state.Load(ctx)
	if err != nil || got == nil || got.ConfigHash != "sha256:old" {
		t.Fatalf("Load before the first save at the new key = %+v, %v; want the old key's state", got, err)
	}
	if err := state.Save(ctx, &AppliedState{Version: AppliedStateVersion, ConfigHash: "sha256:new", AppliedAt: time.Now()}); err != nil {
		t.Fatal(err)
	}
	if got, err = state.Load(ctx); err != nil || got == nil || got.ConfigHash != "sha256:new" {
		t.Fatalf("Load after a save = %+v, %v; want the new key's state", got, err)
	}
	none := EtcdAppliedState{Client: cli, Key: coordination.AppliedState("/rekey-kube", "b"), Fallback: AppliedStatePrefix + "b"}
	if got, err = none.Load(ctx); err != nil || got != nil {
		t.Fatalf("Load with neither key = %+v, %v; want none", got, err)
	}
}
