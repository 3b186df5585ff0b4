package pace

import (
	"math"
	"strings"
	"testing"
	"time"

	clocktesting "k8s.io/utils/clock/testing"
)

// The clients' requests are judged per class, each against its own baseline: a
// controller's burst of LISTs (hundreds of milliseconds each, as before the
// migration) is no congestion, and GETs slowed threefold are, although the LISTs'
// tail hides them in a pooled p99. Judged as one population (before request
// classes), the baseline's p99 was the GETs' 5ms, the burst of LISTs read as clients
// forty times slower and halved the rate.
func TestRequestClassesAreJudgedApart(t *testing.T) {
	// LISTs as slow as before the migration, in a burst (one for every 5 GETs): no
	// congestion. The GETs are judged every window; the LISTs once 5 windows brought
	// them, against their own 200ms.
	t.Run("a burst of usual LISTs", func(t *testing.T) {
		b := newClassesBed(t)
		for i := range 6 {
			v := b.window(5*time.Millisecond, 220*time.Millisecond)
			if v.Change != "double" {
				t.Fatalf("window %d of a burst of usual LISTs: %s (%s: %s p99 %s), want double", i+2, v.Change, v.Cause, v.ServingClass, v.ServingP99)
			}
			if got := v.Classes[RequestList]; (i == 3) != (got.Samples > 0) || (got.Samples > 0 && got.P99 != 220*time.Millisecond) {
				t.Fatalf("window %d judged %d LISTs at p99 %s; they are judged on what 5 windows brought, at 220ms", i+2, got.Samples, got.P99)
			}
		}
	})
	// GETs slowed threefold are congestion, whatever the LISTs' tail.
	t.Run("slowed GETs", func(t *testing.T) {
		b := newClassesBed(t)
		b.window(5*time.Millisecond, 220*time.Millisecond)
		rate := b.p.Rate()
		v := b.window(15*time.Millisecond, 220*time.Millisecond)
		if v.Change != "decrease" || v.Cause != "serving latency" || v.ServingClass != RequestRead || v.ServingP99 != 15*time.Millisecond {
			t.Fatalf("slowed GETs: %s (%s: %s p99 %s), want a decrease for the GETs' 15ms", v.Change, v.Cause, v.ServingClass, v.ServingP99)
		}
		if b.p.Rate() >= rate {
			t.Errorf("rate %v after the GETs slowed, was %v", b.p.Rate(), rate)
		}
	})
	// LISTs slowed past their own target (300ms) are congestion too, as soon as the
	// count of them over it is evidence of a slowdown: here the first window's 20, all
	// over, judged with the first window's LISTs as slow as before that were waiting
	// (alone, they were too few for a judgement: see above).
	t.Run("slowed LISTs", func(t *testing.T) {
		b := newClassesBed(t)
		v := b.window(5*time.Millisecond, 400*time.Millisecond)
		if v.Change != "decrease" || v.ServingClass != RequestList || v.ServingP99 != 400*time.Millisecond {
			t.Fatalf("slowed LISTs: %s (%s: %s p99 %s), want a decrease for the LISTs' 400ms", v.Change, v.Cause, v.ServingClass, v.ServingP99)
		}
		if got := v.Classes[RequestList]; got.Over != 20 || !got.Slowed {
			t.Errorf("LISTs judged %+v, want the 20 slow ones over", got)
		}
		if want := "the apiserver's clients answered slower (list requests: p99 400ms, target 300ms)"; b.p.SlowedBy() != want {
			t.Errorf("slowed by %q, want %q", b.p.SlowedBy(), want)
		}
	})
}

// classesBed is a migration's pacer fed by a ServingLatency on a fake clock, as a
// Writer feeds it, after ten minutes of 600 GETs a minute at 5ms and 6 LISTs at 200ms
// (1% of the requests: a pooled p99 would be the GETs' 5ms).
type classesBed struct {
	t   *testing.T
	clk *clocktesting.FakePassiveClock
	s   *ServingLatency
	p   *pacer
	buf servingSamples
}

func newClassesBed(t *testing.T) *classesBed {
	clk := clocktesting.NewFakePassiveClock(t0)
	s := NewServingLatency(clk)
	for range 10 {
		for i := range 606 {
			if i%101 == 100 {
				s.Observe(RequestList, 200*time.Millisecond)
			} else {
				s.Observe(RequestRead, 5*time.Millisecond)
			}
		}
		clk.SetTime(clk.Now().Add(time.Minute))
	}
	base, end := s.begin(servingQuantile)
	t.Cleanup(end)
	if base[RequestRead] != 5*time.Millisecond || base[RequestList] != 200*time.Millisecond || base[RequestWrite] != 0 {
		t.Fatalf("baselines %s, want get 5ms, list 200ms and none for writes", base)
	}
	b := &classesBed{t: t, clk: clk, s: s, p: newPacer(Options{})}
	b.p.SetServingBaseline(base)
	if v := b.window(5*time.Millisecond, 200*time.Millisecond); !strings.HasPrefix(v.Change, "baseline") {
		t.Fatalf("first window %+v, want etcd's baseline", v)
	}
	return b
}

// window runs transactions 50ms apart, each of 50ms of the allowed rate and after 5
// GETs answered in get and a LIST in list, until a window ends; its verdict.
func (b *classesBed) window(get, list time.Duration) pacerVerdict {
	before := b.p.verdicts
	for range 40 {
		b.clk.SetTime(b.clk.Now().Add(50 * time.Millisecond))
		for range 5 {
			b.s.Observe(RequestRead, get)
		}
		b.s.Observe(RequestList, list)
		b.s.drain(&b.buf)
		for c, ds := range b.buf {
			for _, d := range ds {
				b.p.ObserveServing(RequestClass(c), d)
			}
		}
		b.p.Observe(b.clk.Now(), 2*time.Millisecond, max(1, int(b.p.Rate()/20)), nil)
		if b.p.verdicts != before {
			return b.p.last
		}
	}
	b.t.Fatalf("no window ended at +%s", b.clk.Now().Sub(t0))
	return pacerVerdict{}
}

// Requests of a class without a baseline of its own (fewer than
// minServingBaselineSamples before the migration) are not judged, whatever they take.
func TestAClassWithoutABaselineIsNotJudged(t *testing.T) {
	clk := clocktesting.NewFakePassiveClock(t0)
	s := NewServingLatency(clk)
	for range 200 {
		s.Observe(RequestRead, 5*time.Millisecond)
	}
	for range minServingBaselineSamples - 1 {
		s.Observe(RequestWrite, 10*time.Millisecond)
	}
	b, end := s.begin(servingQuantile)
	defer end()
	if b[RequestRead] == 0 || b[RequestWrite] != 0 {
		t.Fatalf("baselines %s: want one for GETs only", b)
	}
	p := newPacer(Options{})
	p.SetServingBaseline(b)
	clk.SetTime(clk.Now().Add(time.Second))
	for range 200 {
		s.Observe(RequestWrite, time.Second)
	}
	var buf servingSamples
	s.drain(&buf)
	for c, ds := range buf {
		for _, d := range ds {
			p.ObserveServing(RequestClass(c), d)
		}
	}
	if n := p.pendingServing(); n != 0 {
		t.Errorf("%d writes wait for a judgement without a baseline to judge them by", n)
	}
	for _, c := range []struct {
		resource bool
		verb     string
		want     RequestClass
	}{
		{true, "get", RequestRead}, {true, "list", RequestList}, {true, "patch", RequestWrite}, {true, "create", RequestWrite},
		{true, "deletecollection", RequestList}, {false, "get", RequestOther}, {true, "proxy", RequestOther},
	} {
		if got := ClassOf(c.resource, c.verb); got != c.want {
			t.Errorf("ClassOf(%v, %q) = %s, want %s", c.resource, c.verb, got, c.want)
		}
	}
}

// The count of requests over their target that makes a slowdown, at a few sample
// sizes, and the binomial tail it rests on against values computed by hand.
func TestSignificantlyOver(t *testing.T) {
	for _, c := range []struct{ n, slowest, notSlowed int }{
		{10, 2, 1}, {20, 2, 1}, {30, 2, 1}, {100, 4, 3}, {113, 4, 3}, {1000, 16, 15},
	} {
		if !significantlyOver(c.slowest, c.n) || significantlyOver(c.notSlowed, c.n) {
			t.Errorf("of %d: %d over slowed %v, %d over slowed %v; want true, false", c.n, c.slowest,
				significantlyOver(c.slowest, c.n), c.notSlowed, significantlyOver(c.notSlowed, c.n))
		}
	}
	if significantlyOver(0, 5) {
		t.Error("none over is a slowdown")
	}
	// P(X ≥ 2) for X ~ Binomial(113, 0.01) = 1 − 0.99^113 − 113 · 0.01 · 0.99^112.
	want := 1 - math.Pow(0.99, 113) - 113*0.01*math.Pow(0.99, 112)
	if got := binomialUpperTail(113, 2, 0.01); math.Abs(got-want) > 1e-12 {
		t.Errorf("P(X ≥ 2 of 113) = %v, want %v", got, want)
	}
	if got := binomialUpperTail(5, 6, 0.01); got != 0 {
		t.Errorf("P(X ≥ 6 of 5) = %v", got)
	}
}

// Judged among six populations (three apiservers' reads and writes), a window is a
// slowdown at 5% as a whole: 3 of 50 requests over target, a slowdown alone
// (P ≈ 1.4%), is not among six (1.4% > 5%/6); 4 of 50 (P ≈ 0.18%) still is. A pacer
// counts the populations that have a target.
func TestSignificantlyOverAmongSixPopulations(t *testing.T) {
	if !significantlyOver(3, 50) || significantlyOverAmong(3, 50, 6) || !significantlyOverAmong(4, 50, 6) {
		t.Errorf("3 of 50: alone %v, among 6 %v; 4 of 50 among 6 %v; want true, false, true",
			significantlyOver(3, 50), significantlyOverAmong(3, 50, 6), significantlyOverAmong(4, 50, 6))
	}
	p := newPacer(Options{})
	p.SetServingBaseline(servingBaselines{RequestRead: 10 * time.Millisecond, RequestWrite: 20 * time.Millisecond})
	if n := p.judgedPopulations(); n != 2 || !significantlyOverAmong(3, 50, n) {
		t.Error("two populations: 3 of 50 over target is a slowdown (1.4% < 2.5%)")
	}
	for _, m := range []string{"apiserver-1", "apiserver-2"} {
		p.ObserveMember(m, RequestRead, 10*time.Millisecond, nil)
		p.ObserveMember(m, RequestWrite, 20*time.Millisecond, nil)
		p.ObserveMember(m, RequestList, 0, nil) // no baseline: not judged, not counted
	}
	if n := p.judgedPopulations(); n != 6 || significantlyOverAmong(3, 50, n) || !significantlyOverAmong(4, 50, n) {
		t.Error("six populations: 3 of 50 over target is no slowdown, 4 of 50 is")
	}
}
