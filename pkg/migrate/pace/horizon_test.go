package pace

import (
	"testing"
	"time"
)

// horizonBed drives a pacer window by window: 20 transactions 50ms apart, 100 GETs
// in all, slow of them answered in 20ms (target 12ms) and the rest in 8ms.
type horizonBed struct {
	t   *testing.T
	now time.Time
	p   *pacer
}

func (b *horizonBed) window(slow int) pacerVerdict {
	b.t.Helper()
	before := b.p.verdicts
	for i := range 40 {
		b.now = b.now.Add(50 * time.Millisecond)
		for j := range 5 {
			lat := 8 * time.Millisecond
			if 5*i+j < slow {
				lat = 20 * time.Millisecond
			}
			b.p.ObserveServing(RequestRead, lat)
		}
		b.p.Observe(b.now, 2*time.Millisecond, max(1, int(b.p.Rate()/20)), nil)
		if b.p.verdicts != before {
			return b.p.last
		}
	}
	b.t.Fatalf("no window ended at +%s", b.now.Sub(t0))
	return pacerVerdict{}
}

func newHorizonBed(t *testing.T, o Options) *horizonBed {
	b := &horizonBed{t: t, now: t0, p: newPacer(o)}
	b.p.SetServingBaseline(servingBaselines{RequestRead: 8 * time.Millisecond})
	return b
}

// The verifying re-scan's pacer takes over the horizon of the writes' pacer: the slow
// requests the writes cost the clients count against the re-scan's allowance, so a
// re-scan right after writes that used most of it halves at its first slowed window,
// where a pacer with a horizon of its own would tolerate it.
func TestReScanInheritsTheClientsHorizon(t *testing.T) {
	writes := newHorizonBed(t, Options{})
	writes.window(0)
	for i := range 3 {
		if v := writes.window(10); v.Change != "tolerate" {
			t.Fatalf("slowed window %d of the writes: %s, want tolerate (10 slow of about 6,000 a minute)", i+1, v.Change)
		}
	}
	if spent := writes.p.horizonSpent(int(RequestRead), writes.now); spent < 0.4 || spent >= horizonSpend {
		t.Fatalf("the writes used %.2f of the clients' allowance, want just under %.2f", spent, horizonSpend)
	}

	rescan := &horizonBed{t: t, now: writes.now, p: newPacer(Options{})}
	rescan.p.inheritServingTargets(writes.p)
	rescan.p.slowStart = true
	if got, want := rescan.p.horizonSpent(int(RequestRead), rescan.now), writes.p.horizonSpent(int(RequestRead), writes.now); got != want {
		t.Fatalf("the re-scan starts having used %.2f of the clients' allowance, want the writes' %.2f", got, want)
	}
	if v := rescan.window(10); v.Change != "decrease" {
		t.Errorf("the re-scan's first slowed window after the writes: %s, want decrease (the allowance is the writes' too)", v.Change)
	}

	fresh := newHorizonBed(t, Options{})
	fresh.window(0)
	if v := fresh.window(10); v.Change != "tolerate" {
		t.Errorf("a fresh pacer's first slowed window: %s, want tolerate", v.Change)
	}
}

// Gentle judges each window alone; so does an explicit negative horizon. Either way
// the first slowed window halves.
func TestWithoutAHorizonEverySlowedWindowDecreases(t *testing.T) {
	for name, o := range map[string]Options{"gentle": {Priority: PriorityGentle}, "no horizon": {ServingHorizon: -1}} {
		b := newHorizonBed(t, o)
		b.window(0)
		if v := b.window(10); v.Change != "decrease" {
			t.Errorf("%s: first slowed window %s, want decrease", name, v.Change)
		}
		if got := b.p.horizonSpent(int(RequestRead), b.now); got < 1e300 {
			t.Errorf("%s: horizonSpent %v, want +Inf (no horizon)", name, got)
		}
	}
}

// The horizon forgets windows older than itself: a slowdown a minute ago no longer
// counts.
func TestTheHorizonSlides(t *testing.T) {
	b := newHorizonBed(t, Options{ServingHorizon: 5 * time.Second})
	b.window(0)
	b.window(10)
	for range 6 {
		b.window(0)
	}
	if n := len(b.p.pops[RequestRead].horizon); n > 5 {
		t.Fatalf("%d windows kept by a 5s horizon", n)
	}
	if spent := b.p.horizonSpent(int(RequestRead), b.now); spent != 0 {
		t.Errorf("spent %.2f of the allowance 6 windows after the only slowed one, want 0", spent)
	}
}

// The next resource of a rotation goes on from the horizon of the one before
// (Options.ResumeHorizon): its first slowed window is judged against what is left of
// the minute's allowance, not a fresh one. Windows older than the horizon by then no
// longer count.
func TestTheNextMigrationGoesOnFromTheHorizon(t *testing.T) {
	first := newHorizonBed(t, Options{})
	first.window(0)
	for range 3 {
		first.window(10)
	}
	h := first.p.clientsHorizon()

	next := newHorizonBed(t, Options{ResumeHorizon: h})
	next.now = first.now
	if got, want := next.p.horizonSpent(int(RequestRead), next.now), first.p.horizonSpent(int(RequestRead), first.now); got != want {
		t.Fatalf("the next migration starts having used %.2f of the allowance, want the first one's %.2f", got, want)
	}
	next.window(0)
	if v := next.window(10); v.Change != "decrease" {
		t.Errorf("the next migration's first slowed window: %s, want decrease", v.Change)
	}

	later := newHorizonBed(t, Options{ResumeHorizon: h})
	later.now = first.now.Add(DefaultServingHorizon)
	later.window(0)
	if v := later.window(10); v.Change != "tolerate" {
		t.Errorf("a migration a minute later, handed the same horizon: %s, want tolerate (the old windows are past it)", v.Change)
	}
	if got := newPacer(Options{ServingHorizon: -1}).clientsHorizon(); len(got.pops) > 0 {
		t.Errorf("a pacer without a horizon hands one on: %+v", got)
	}
}

// With a light workload the clients are judged only every few windows (100 requests,
// or what 5 windows brought); slow start doubles once while their requests wait, then
// holds until they are judged, so the rate is never more than four times the last one
// they were judged at.
func TestSlowStartDoublesOnceWithoutAJudgement(t *testing.T) {
	p := newPacer(Options{})
	p.SetServingBaseline(servingBaselines{RequestRead: 8 * time.Millisecond})
	now := t0
	var changes []string
	judgedAt := p.Rate()
	for range 12 {
		before := p.verdicts
		for i := 0; p.verdicts == before && i < 100; i++ {
			now = now.Add(50 * time.Millisecond)
			if i%5 == 0 {
				p.ObserveServing(RequestRead, 8*time.Millisecond) // 4 requests a second
			}
			p.Observe(now, 2*time.Millisecond, max(1, int(p.Rate()/20)), nil)
		}
		v := p.last
		changes = append(changes, v.Change)
		if v.ServingSamples > 0 {
			judgedAt = v.Achieved
		}
		if p.Rate() > 4.5*judgedAt {
			t.Fatalf("after %v the rate is %v/s, more than four times the %v/s the clients were last judged at", changes, p.Rate(), judgedAt)
		}
	}
	holds := 0
	for _, c := range changes {
		if c == "hold" {
			holds++
		}
	}
	if holds == 0 {
		t.Errorf("changes %v: slow start never held for a judgement", changes)
	}
}
