package cluster

import (
	"fmt"
	"slices"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// The fence's resynchronisation after this apiserver dropped out of the cluster.
//
// The fence decides from a view of the other members that the watch keeps current. Two
// things make that view a picture of a cluster that may be gone:
//   - the member lease ended (it expired while etcd was unreachable, or the keep-alive
//     failed): the record disappeared, so the others stopped counting this apiserver —
//     their guards let keys go that only it wrote with, their fences promoted keys it
//     cannot read — and nothing of that may have reached this view yet;
//   - the clock moved more than a lease TTL between two ticks: the process (or its VM)
//     was paused, or starved, long enough for the lease to expire, and the view has
//     seen nothing meanwhile.
//
// Either one is a loss (leaseLost, or a tick that finds the gap). From a loss on, every
// rule refuses writes until both
//  1. this apiserver's record was put again (recordPut, for a Put sent after the
//     latest loss, at revision P): from P on, every other member's guard and fence
//     count it again, and
//  2. a view at a revision of at least P that shows its record was stepped in: it holds
//     everything the others did before they could see it again.
//
// The writers are then decided afresh: a key this apiserver wrote with before the loss
// is promoted again, which needs every live member's ack (and the handshake's read),
// so a key the others dropped meanwhile is never written again. A second loss before
// the end starts over (the Put must follow it). Nothing here sleeps or reads a clock:
// the Node steps the losses, the Puts, the views and the ticks in.

// resync is a hold of every write after a loss.
type resync struct {
	since time.Time
	// why names the loss, for the refusals, the log and readiness.
	why string
	// putRev is the revision of the first Put of this apiserver's record sent after the
	// latest loss (0 until there is one).
	putRev int64
}

// leaseLost says this apiserver's member lease ended (expired or revoked) at At.
type leaseLost struct{ At time.Time }

// recordPut says this apiserver's record was put at revision Rev. Losses is the
// fence's Losses() read before the Put was sent: a Put sent before the latest loss
// proves nothing about the record after it.
type recordPut struct {
	Rev    int64
	Losses int
}

func (leaseLost) fenceEvent() {}
func (recordPut) fenceEvent() {}

// waitingForResync is what a hold of the resynchronisation waits for.
const waitingForResync = "(this apiserver's record published again, and a view of the members that includes it)"

// SetLeaseTTL makes the fence look for pauses: a tick more than ttl after the previous
// one (or after now, when the ticks start) is a loss. 0 turns it off.
func (f *fence) SetLeaseTTL(ttl time.Duration, now time.Time) {
	f.ttl = ttl
	if now.After(f.now) {
		f.now = now
	}
}

// Losses counts the losses stepped in so far (recordPut.Losses).
func (f *fence) Losses() int { return f.losses }

// Resync reports whether writes are held to resynchronise, since when and why.
func (f *fence) Resync() (held bool, since time.Time, why string) {
	if f.resync == nil {
		return false, time.Time{}, ""
	}
	return true, f.resync.since, f.resync.why
}

// AwaitsPut reports whether the resynchronisation waits for this apiserver's record to
// be put (the Node retries publishing meanwhile).
func (f *fence) AwaitsPut() bool { return f.resync != nil && f.resync.putRev == 0 }

// checkPause starts a resynchronisation when now is more than a lease TTL after the
// fence's previous tick.
func (f *fence) checkPause(now time.Time) {
	if f.ttl <= 0 || f.now.IsZero() {
		return
	}
	if gap := now.Sub(f.now); gap > f.ttl {
		f.lose(now, fmt.Sprintf("this apiserver did not run for %s, longer than its %s member lease (a paused process or VM, or a starved one)", gap.Round(time.Millisecond), f.ttl))
	}
}

// stepResync feeds a leaseLost or a recordPut.
func (f *fence) stepResync(ev fenceEvent) {
	switch e := ev.(type) {
	case leaseLost:
		at := e.At
		if at.IsZero() || f.now.After(at) {
			at = f.now
		}
		f.lose(at, "its member lease ended, so the other apiservers stopped counting it")
	case recordPut:
		if f.resync == nil || f.resync.putRev != 0 || e.Losses != f.losses || e.Rev <= 0 {
			return
		}
		f.resync.putRev = e.Rev
		f.maybeResynced()
	}
}

// lose records a loss at now: every write is held until a Put sent after it and a view
// that includes that Put.
func (f *fence) lose(now time.Time, why string) {
	f.losses++
	f.ready.Lost = true
	if f.resync == nil {
		f.resync = &resync{since: now}
	}
	f.resync.why, f.resync.putRev = why, 0
}

// viewStepped takes the revision of a view just stepped in, and whether it shows this
// apiserver's record.
func (f *fence) viewStepped(e membersChanged) {
	if e.Rev > 0 {
		f.viewRev = max(f.viewRev, e.Rev)
		f.selfListed = slices.ContainsFunc(e.Members, func(m MemberState) bool { return m.APIServerID == f.self })
	}
	f.maybeResynced()
}

// maybeResynced ends the resynchronisation once the view is at or after the Put and
// shows the record.
func (f *fence) maybeResynced() {
	if f.resync != nil && f.resync.putRev > 0 && f.viewRev >= f.resync.putRev && f.selfListed {
		f.ready.Resynced, f.ready.HeldSince = true, f.resync.since
		f.resync = nil
	}
}

// resyncWriters refuses every write of next while the resynchronisation lasts, and
// records each rule as a refused hold of its configured key.
func (f *fence) resyncWriters(next []transformers.RuleInfo) map[string]transformers.Writer {
	out := map[string]transformers.Writer{}
	holds := map[string]Hold{}
	for _, n := range next {
		if len(n.ReadKeys) == 0 {
			continue
		}
		why := fmt.Sprintf("writes of %s are held: %s; they resume once its member record is published again and its view of the other apiservers includes it (they may have changed keys meanwhile)",
			n.Resource, f.resync.why)
		out[n.Resource] = transformers.Writer{Refuse: why}
		holds[n.Resource] = Hold{Resource: n.Resource, Held: n.ReadKeys[0], Since: f.resync.since, WaitingFor: []string{waitingForResync}, Refused: why}
	}
	f.holds = holds
	return out
}
