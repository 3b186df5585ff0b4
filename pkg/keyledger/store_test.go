package keyledger

import (
	"context"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Two members writing with the same key record it once: the second finds it recorded
// and writes nothing, until the touch interval has passed.
func TestRecordIsIdempotentAcrossMembers(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(t0)
	rules := func() []transformers.RuleInfo { return rule(aesgcm("key1", "c1")) }
	store := Store{Client: cli, Key: Key("/rekey")}
	a := &Recorder{Store: store, Rules: rules, Clock: clk}
	b := &Recorder{Store: store, Rules: rules, Clock: clk}
	for i, r := range []*Recorder{a, b, a, b} {
		written, err := r.Record(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if written != (i == 0) {
			t.Fatalf("record %d wrote %v, want only the first to write", i, written)
		}
	}
	l, modRev, _, err := store.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Entries) != 1 {
		t.Fatalf("entries = %+v, want one", l.Entries)
	}
	clk.SetTime(t0.Add(DefaultTouchInterval))
	if written, err := b.Record(ctx); err != nil || !written {
		t.Fatalf("after the touch interval: written %v, %v; want last use refreshed", written, err)
	}
	l2, modRev2, _, err := store.Load(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if modRev2 <= modRev || l2.Entries[0].LastUse.Revision < modRev || !l2.Entries[0].LastUse.At.Equal(t0.Add(DefaultTouchInterval)) {
		t.Fatalf("last use = %+v at mod revision %d (was %d), want refreshed at a later revision", l2.Entries[0].LastUse, modRev2, modRev)
	}
	if l2.Entries[0].FirstUse != l.Entries[0].FirstUse {
		t.Fatalf("first use changed: %+v → %+v", l.Entries[0].FirstUse, l2.Entries[0].FirstUse)
	}
}

// Seen hands every Record's ledger to the caller, whether or not Record wrote it: a
// member that writes nothing new still learns the KMS key ids another superseded.
func TestRecorderSeenHandsOverTheLedger(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx := context.Background()
	clk := clocktesting.NewFakeClock(t0)
	store := Store{Client: cli, Key: Key("/rekey")}
	keyID := "sha256:aaaa"
	writer := &Recorder{Store: store, Rules: func() []transformers.RuleInfo { return rule(kmsID(keyID)) }, Clock: clk}
	if _, err := writer.Record(ctx); err != nil {
		t.Fatal(err)
	}
	keyID = "sha256:bbbb"
	if _, err := writer.Record(ctx); err != nil {
		t.Fatal(err)
	}
	var seen map[string][]string
	reader := &Recorder{Store: store, Clock: clk, Seen: func(l *Ledger) { seen = l.SupersededKMSKeyIDs() }}
	if written, err := reader.Record(ctx); err != nil || written {
		t.Fatalf("a member with no rules: written %v, %v; want nothing written", written, err)
	}
	if got := seen["vault"]; len(got) != 1 || got[0] != "sha256:aaaa" {
		t.Fatalf("superseded key ids seen = %v, want vault's sha256:aaaa", seen)
	}
}

// Run records at once and then every interval of its clock: stepping a fake clock
// past the interval records again (the ledger's last use moves), without waiting on
// the wall clock.
func TestRecorderRunRecordsEveryIntervalOfItsClock(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	clk := clocktesting.NewFakeClock(t0)
	store := Store{Client: cli, Key: Key("/rekey")}
	records := make(chan *Ledger, 10)
	r := &Recorder{Store: store, Rules: func() []transformers.RuleInfo { return rule(aesgcm("key1", "c1")) }, Clock: clk,
		Seen: func(l *Ledger) { records <- l }}
	done := make(chan struct{})
	go func() { defer close(done); r.Run(ctx, time.Hour) }()
	defer func() { cancel(); <-done }()
	first := <-records
	if len(first.Entries) != 1 || !first.Entries[0].LastUse.At.Equal(t0) {
		t.Fatalf("the first record: %+v, want key1 used at t0", first.Entries)
	}
	// The ticker exists once Run waits on it; then a step of the clock fires it.
	for deadline := time.Now().Add(10 * time.Second); !clk.HasWaiters(); time.Sleep(time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("Run never waits on its clock (a wall-clock ticker?)")
		}
	}
	later := t0.Add(time.Hour)
	clk.SetTime(later)
	select {
	case l := <-records:
		if !l.Entries[0].LastUse.At.Equal(later) {
			t.Fatalf("the record after an interval: last use %v, want %v", l.Entries[0].LastUse.At, later)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("stepping the recorder's clock past its interval recorded nothing")
	}
}
