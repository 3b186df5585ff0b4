package cluster

import (
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// resyncFence is a fence of apiserver a, looking for pauses with a 10 s lease, that
// has seen a and b (both reading k1) at revision 5 and writes secrets with k1.
func resyncFence(t *testing.T) (*fence, []transformers.RuleInfo, func(rev int64, members ...MemberState)) {
	t.Helper()
	f := newFence("a", epoch)
	f.SetLeaseTTL(10*time.Second, epoch)
	a, b := parseMember(t, "a", "secrets: aesgcm/k1", epoch), parseMember(t, "b", "secrets: aesgcm/k1", epoch)
	view := func(rev int64, members ...MemberState) { f.Step(membersChanged{Members: members, Rev: rev}) }
	view(5, a, b)
	rules := parseRules(t, "secrets: aesgcm/k1")
	if w := f.Decide(nil, rules).Writers; len(w) != 0 {
		t.Fatalf("before any loss: writers %v, want k1 (no change)", w)
	}
	return f, rules, view
}

// refusal is the fence's refusal of secrets' writes ("" when it lets them through).
func refusal(f *fence, rules []transformers.RuleInfo) string {
	return f.Decide(rules, rules).Writers["secrets"].Refuse
}

// TestFenceHoldsWritesAfterAPauseUntilTheViewIncludesItsRecord: a tick more than a
// lease TTL after the previous one (a paused process or VM) holds every write — also
// the key the rule wrote with, and the KMS key-id fence — until this apiserver's record
// was put again after the pause and a view at that Put's revision or later, showing the
// record, was stepped in. Ticks a TTL apart, or less, are no pause.
func TestFenceHoldsWritesAfterAPauseUntilTheViewIncludesItsRecord(t *testing.T) {
	f, rules, view := resyncFence(t)
	a, b := parseMember(t, "a", "secrets: aesgcm/k1", epoch), parseMember(t, "b", "secrets: aesgcm/k1", epoch)

	f.Step(tick{Now: epoch.Add(time.Second)})
	f.Step(tick{Now: epoch.Add(11 * time.Second)}) // exactly a TTL later: no pause
	if why := refusal(f, rules); why != "" {
		t.Fatalf("ticks one TTL apart: writes refused (%s)", why)
	}
	if r := f.Ready(); r.Lost || r.Resynced {
		t.Fatalf("ticks one TTL apart: the fence reports %+v", r)
	}
	f.Step(tick{Now: epoch.Add(23 * time.Second)}) // 12 s later: a pause
	if r := f.Ready(); !r.Lost || r.Resynced {
		t.Fatalf("after a 12 s pause: the fence reports %+v, want a loss", r)
	}
	if r := f.Ready(); r.Lost {
		t.Fatal("Ready reported the loss twice")
	}
	why := refusal(f, rules)
	if !strings.Contains(why, "writes of secrets are held: this apiserver did not run for 12s, longer than its 10s member lease") {
		t.Fatalf("after a 12 s pause: refusal %q, want the hold naming the pause", why)
	}
	if h := f.Holds(); len(h) != 1 || h[0].Refused != why || h[0].WaitingFor[0] != waitingForResync {
		t.Fatalf("holds during the resynchronisation: %+v", h)
	}
	if f.MayWriteKeyID("vault", "h1") {
		t.Fatal("the KMS key-id fence is open during the resynchronisation")
	}
	if !f.AwaitsPut() {
		t.Fatal("the resynchronisation does not wait for the record's Put")
	}

	// The old watch catches up to revision 7 (before the Put): still held.
	view(7, a, b)
	if refusal(f, rules) == "" {
		t.Fatal("writes resumed with a view from before the record's Put")
	}
	// A Put sent before the pause was noticed proves nothing.
	f.Step(recordPut{Rev: 8, Losses: f.Losses() - 1})
	if !f.AwaitsPut() {
		t.Fatal("a Put sent before the loss counted")
	}
	f.Step(recordPut{Rev: 9, Losses: f.Losses()})
	if f.AwaitsPut() || refusal(f, rules) == "" {
		t.Fatal("writes resumed at the Put, before a view that includes it")
	}
	// A view at the Put's revision without the record (the lease expired again): held.
	view(9, b)
	if refusal(f, rules) == "" {
		t.Fatal("writes resumed with a view that does not show this apiserver's record")
	}
	if r := f.Ready(); r.Resynced {
		t.Fatal("the fence reported the end of the resynchronisation before it ended")
	}
	view(10, a, b)
	if r := f.Ready(); !r.Resynced || !r.HeldSince.Equal(epoch.Add(23*time.Second)) || r.Lost {
		t.Fatalf("at the view that ends the resynchronisation the fence reports %+v, want its end and the hold's start", r)
	}
	if why := refusal(f, rules); why != "" {
		t.Fatalf("with a view after the Put that shows the record: writes refused (%s)", why)
	}
	if held, _, _ := f.Resync(); held || !f.MayWriteKeyID("vault", "h1") {
		t.Fatal("the resynchronisation did not end")
	}
}

// TestFenceHoldsWritesAfterALostLease: a lost lease holds every write the same way; a
// view that already includes the Put ends it at the Put; a second loss before the end
// needs a Put of its own.
func TestFenceHoldsWritesAfterALostLease(t *testing.T) {
	f, rules, view := resyncFence(t)
	a, b := parseMember(t, "a", "secrets: aesgcm/k1", epoch), parseMember(t, "b", "secrets: aesgcm/k1", epoch)

	f.Step(leaseLost{At: epoch.Add(time.Second)})
	if why := refusal(f, rules); !strings.Contains(why, "its member lease ended") {
		t.Fatalf("after the lease ended: refusal %q", why)
	}
	f.Step(recordPut{Rev: 12, Losses: f.Losses()})
	f.Step(leaseLost{At: epoch.Add(2 * time.Second)}) // lost again before the view caught up
	view(12, a, b)
	if refusal(f, rules) == "" {
		t.Fatal("a Put from before the second loss ended the resynchronisation")
	}
	view(20, a, b) // the watch is ahead of the Put below
	f.Step(recordPut{Rev: 15, Losses: f.Losses()})
	if why := refusal(f, rules); why != "" {
		t.Fatalf("a Put the view already includes did not end the resynchronisation: %s", why)
	}
	// Without a lease TTL (the transcripts), a long gap between ticks is no pause.
	g := newFence("a", epoch)
	g.Step(membersChanged{Members: []MemberState{a, b}, Rev: 1})
	g.Step(tick{Now: epoch.Add(time.Hour)})
	if held, _, _ := g.Resync(); held {
		t.Fatal("a fence without a lease TTL took a gap for a pause")
	}
}
