package kmsv2

import (
	"context"
	"errors"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// When the fence is open at the first seed (one apiserver, or every plugin already
// reports the key id), no write ever sees the first-seed hold: the driver asks before it
// publishes the seed, not one recheck interval later. When it is closed, writes are
// refused as WriteRefusedError (503) that migration still reads as ErrKMSUnavailable.
func TestFirstSeedHoldOnlyWhenTheFenceIsClosed(t *testing.T) {
	tp := startPlugin(t, "kek-1")
	open := newProvider(t, "open", tp.endpoint, FactoryOptions{
		MayWriteKeyID: func(string, string) bool { return true },
		FirstSeedHold: 30 * time.Second, FenceRecheckInterval: time.Hour,
	})
	if _, err := open.Seal(context.Background(), []byte("x"), value.DefaultContext("/k")); err != nil {
		t.Fatalf("first write with an open fence: %v", err)
	}
	closed := newProvider(t, "closed", tp.endpoint, FactoryOptions{
		MayWriteKeyID: func(string, string) bool { return false },
		FirstSeedHold: 30 * time.Second, FenceRecheckInterval: time.Hour,
	})
	_, err := closed.Seal(context.Background(), []byte("x"), value.DefaultContext("/k"))
	var refused *transformers.WriteRefusedError
	if !errors.As(err, &refused) || !errors.Is(err, transformers.ErrKMSUnavailable) {
		t.Fatalf("first write with a closed fence: %v; want a WriteRefusedError matching ErrKMSUnavailable", err)
	}
}
