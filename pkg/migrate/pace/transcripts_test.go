package pace

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"
	"time"

	"github.com/cockroachdb/datadriven"
	"k8s.io/apimachinery/pkg/api/resource"
)

// t0 is where the transcripts' and the tests' fake clocks start.
var t0 = time.Date(2026, 1, 1, 0, 0, 0, 0, time.UTC)

// TestPacingTranscripts runs testdata/pacing_*.txt and testdata/space_*.txt: the pacer
// (adaptive rate) and the space gate as stories, with scripted latencies and etcd
// readings and a clock that moves only when told. `-rewrite` rewrites the answers.
//
// Pacer commands:
//
//	pacer [ceiling=N] [target=D] [window=D] [min=N] [increase=N] [serving=D] [resume=N] [known=N]
//	      [priority=P] [factor=F]
//	                      a new pacer at +0s; serving is the clients' baseline p99
//	                      (of GETs, or per class: get:8ms,list:300ms),
//	                      resume the previous migration's ending rate, known an earlier
//	                      migration's sustained rate, priority gentle|normal|fast,
//	                      factor the clients' latency factor; prints its rate
//	txns n=N latency=D [objects=K] [every=D] [errors=E] [clients=C clientlatency=D [class=K]]
//	     [lists=L listlatency=D] [watchlag=D]
//	                      N transactions of K objects (default 64), one ending every D
//	                      (default: latency), the first E failing, C client requests
//	                      of class K (get, write, list, other; default get) answered in
//	                      clientlatency and L LISTs in listlatency before each, the
//	                      watch cache watchlag behind after each; prints each window's
//	                      verdict and the rate after it
//	     [member=M memberbaseline=D memberclients=C memberlatency=D]
//	                      and before each, a report of apiserver M: C GETs answered
//	                      in memberlatency by clients whose p99 was memberbaseline
//	                      before the migration
//
//	slowedby              why the rate is below where it started (SlowedBy)
//
// Space gate commands:
//
//	paused n=N every=D clients=C clientlatency=D [class=K]
//	                      while the migration is paused to measure its clients: N
//	                      steps of D, C client requests answered in clientlatency
//	                      each; prints the pause's measurement when it ends
//
//	gate [quota=SIZE] [fraction=F] [interval=D]
//	                      a new gate at +0s (sizes as 32Mi)
//	etcd size=SIZE inuse=SIZE [nospace] [error]
//	                      what the next readings of etcd return
//	write SIZE [times=N] [every=D]
//	                      moves the clock by D (default 0) and asks to write SIZE bytes,
//	                      N times: each answer, the readings it needed, the room left
//	refused               a write failed with NOSPACE
func TestPacingTranscripts(t *testing.T) {
	datadriven.Walk(t, "testdata", func(t *testing.T, path string) {
		base := path[strings.LastIndex(path, "/")+1:]
		if !strings.HasPrefix(base, "pacing_") && !strings.HasPrefix(base, "space_") {
			t.Skip("not a pacing or space transcript")
		}
		h := &pacingHarness{now: t0}
		datadriven.RunTest(t, path, func(t *testing.T, d *datadriven.TestData) string {
			return h.run(t, d)
		})
	})
}

type pacingHarness struct {
	now     time.Time
	pacer   *pacer
	gate    *spaceGate
	reading etcdSpace
}

func (h *pacingHarness) at() string { return "+" + h.now.Sub(t0).String() }

func (h *pacingHarness) run(t *testing.T, d *datadriven.TestData) string {
	var b strings.Builder
	switch d.Cmd {
	case "pacer":
		var o Options
		var target, window, serving string
		d.MaybeScanArgs(t, "serving", &serving)
		d.MaybeScanArgs(t, "ceiling", &o.Ceiling)
		d.MaybeScanArgs(t, "min", &o.MinRate)
		d.MaybeScanArgs(t, "increase", &o.Increase)
		d.MaybeScanArgs(t, "resume", &o.ResumeRate)
		d.MaybeScanArgs(t, "known", &o.KnownRate)
		d.MaybeScanArgs(t, "factor", &o.ServingFactor)
		var priority string
		d.MaybeScanArgs(t, "priority", &priority)
		var err error
		if o.Priority, err = ParsePriority(priority); err != nil {
			d.Fatalf(t, "%v", err)
		}
		d.MaybeScanArgs(t, "target", &target)
		d.MaybeScanArgs(t, "window", &window)
		o.TargetLatency, o.Window = duration(t, d, target), duration(t, d, window)
		h.now, h.pacer = t0, newPacer(o)
		h.pacer.canProbe = true // the harness drives it as a Writer does
		if serving != "" {
			h.pacer.SetServingBaseline(baselines(t, d, serving))
			return fmt.Sprintf("rate %s %s", rateText(h.pacer.Rate()), targetsText(h.pacer, "serving"))
		}
		return "rate " + rateText(h.pacer.Rate())
	case "txns":
		n, objects, errs, clients, lists := 0, 64, 0, 0, 0
		var latency, every, clientLatency, listLatency, watchLag, class string
		d.MaybeScanArgs(t, "class", &class)
		d.MaybeScanArgs(t, "lists", &lists)
		d.MaybeScanArgs(t, "listlatency", &listLatency)
		d.MaybeScanArgs(t, "watchlag", &watchLag)
		d.MaybeScanArgs(t, "clients", &clients)
		d.MaybeScanArgs(t, "clientlatency", &clientLatency)
		d.ScanArgs(t, "n", &n)
		d.ScanArgs(t, "latency", &latency)
		d.MaybeScanArgs(t, "objects", &objects)
		d.MaybeScanArgs(t, "every", &every)
		d.MaybeScanArgs(t, "errors", &errs)
		var member, memberBaseline, memberLatency string
		memberClients := 0
		d.MaybeScanArgs(t, "member", &member)
		d.MaybeScanArgs(t, "memberbaseline", &memberBaseline)
		d.MaybeScanArgs(t, "memberclients", &memberClients)
		d.MaybeScanArgs(t, "memberlatency", &memberLatency)
		var latencies []time.Duration
		lat := duration(t, d, latency)
		step := lat
		if every != "" {
			step = duration(t, d, every)
		}
		for i := range n {
			h.now = h.now.Add(step)
			var err error
			if i < errs {
				err = errors.New("etcdserver: request timed out")
			}
			for range clients {
				h.pacer.ObserveServing(requestClass(t, d, class), duration(t, d, clientLatency))
			}
			for range lists {
				h.pacer.ObserveServing(RequestList, duration(t, d, listLatency))
			}
			if watchLag != "" {
				h.pacer.ObserveWatchLag(duration(t, d, watchLag))
			}
			for range memberClients {
				latencies = append(latencies, duration(t, d, memberLatency))
			}
			if member != "" {
				h.pacer.ObserveMember(member, RequestRead, duration(t, d, memberBaseline), latencies)
				latencies = latencies[:0]
			}
			before := h.pacer.verdicts
			h.pacer.Observe(h.now, lat, objects, err)
			if v := h.pacer.last; h.pacer.verdicts != before {
				fmt.Fprintf(&b, "%s: window p90=%s samples=%d errors=%d achieved=%.0f/s", h.at(), v.P90, v.Samples, v.Errors, v.Achieved)
				if v.ServingSamples > 0 {
					b.WriteString(" clients " + classesText(h.pacer, v))
				}
				if v.WatchLagSeen {
					fmt.Fprintf(&b, " watch cache lag=%s", v.WatchLag)
				}
				fmt.Fprintf(&b, " → %s", v.Change)
				if v.Cause != "" && (h.pacer.serving || v.WatchLagSeen) {
					fmt.Fprintf(&b, " (%s)", v.Cause)
				}
				fmt.Fprintf(&b, ": rate %s target %s", rateText(h.pacer.Rate()), h.pacer.Target())
				if v.Change == "rebaseline" {
					b.WriteString(" " + targetsText(h.pacer, "clients"))
				}
				if v.Change == "probe" {
					b.WriteString(" (paused)")
				}
				b.WriteString("\n")
			}
		}
		if b.Len() == 0 {
			return "no window ended"
		}
	case "slowedby":
		return h.pacer.SlowedBy()
	case "paused":
		var every, clientLatency, class string
		n, clients := 0, 0
		d.ScanArgs(t, "n", &n)
		d.ScanArgs(t, "every", &every)
		d.ScanArgs(t, "clients", &clients)
		d.ScanArgs(t, "clientlatency", &clientLatency)
		d.MaybeScanArgs(t, "class", &class)
		if !h.pacer.Probing() {
			d.Fatalf(t, "the migration is not paused")
		}
		for range n {
			h.now = h.now.Add(duration(t, d, every))
			for range clients {
				h.pacer.ObserveServing(requestClass(t, d, class), duration(t, d, clientLatency))
			}
			h.pacer.tickProbe(h.now)
			if !h.pacer.Probing() {
				v := h.pacer.last
				fmt.Fprintf(&b, "%s: paused: clients %s → %s: rate %s %s\n%s\n", h.at(), classesText(h.pacer, v), v.Change, rateText(h.pacer.Rate()),
					targetsText(h.pacer, "clients"), h.pacer.SlowedBy())
				break
			}
		}
		if b.Len() == 0 {
			return "still paused"
		}
	case "gate":
		var o SpaceOptions
		var quota, interval string
		d.MaybeScanArgs(t, "quota", &quota)
		d.MaybeScanArgs(t, "fraction", &o.MaxFraction)
		d.MaybeScanArgs(t, "interval", &interval)
		o.QuotaBytes, o.CheckInterval = size(t, d, quota), duration(t, d, interval)
		h.now, h.gate = t0, newSpaceGate(o)
		return fmt.Sprintf("limit %s", bytesText(h.gate.limit()))
	case "etcd":
		var sz, inuse string
		d.ScanArgs(t, "size", &sz)
		d.ScanArgs(t, "inuse", &inuse)
		h.reading = etcdSpace{DBSize: size(t, d, sz), DBSizeInUse: size(t, d, inuse), NoSpace: d.HasArg("nospace")}
		if d.HasArg("error") {
			h.reading.Err = errors.New("context deadline exceeded")
		}
		return "ok"
	case "write":
		times := 1
		var every string
		d.MaybeScanArgs(t, "times", &times)
		d.MaybeScanArgs(t, "every", &every)
		n := size(t, d, d.CmdArgs[0].Key)
		for range times {
			h.now = h.now.Add(duration(t, d, every))
			dec := h.gate.Admit(h.now, n)
			for tries := 0; dec == spaceMeasure; tries++ {
				if tries == 2 {
					d.Fatalf(t, "the gate asks for reading after reading")
				}
				h.gate.Measured(h.now, h.reading)
				fmt.Fprintf(&b, "%s: read etcd: size %s, in use %s%s\n", h.at(), bytesText(h.reading.DBSize), bytesText(h.reading.DBSizeInUse), alarmText(h.reading))
				dec = h.gate.Admit(h.now, n)
			}
			switch {
			case dec == spaceWrite:
				fmt.Fprintf(&b, "%s: write %s, room left %s\n", h.at(), bytesText(n), bytesText(h.gate.room))
			case h.gate.Paused() == "":
				fmt.Fprintf(&b, "%s: wait %s for etcd to report the last writes\n", h.at(), h.gate.RetryIn(h.now))
			default:
				fmt.Fprintf(&b, "%s: paused (%s): %s\n", h.at(), h.gate.Paused(), h.gate.Condition())
			}
		}
	case "refused":
		h.gate.NoSpace(h.now)
		return fmt.Sprintf("paused (%s)", h.gate.Paused())
	default:
		d.Fatalf(t, "unknown command %q", d.Cmd)
	}
	return b.String()
}

// baselines reads a pacer's serving=: one duration (the GETs' baseline) or
// class:duration pairs (get:8ms,list:300ms).
func baselines(t *testing.T, d *datadriven.TestData, s string) servingBaselines {
	var b servingBaselines
	if !strings.Contains(s, ":") {
		b[RequestRead] = duration(t, d, s)
		return b
	}
	for _, kv := range strings.Split(s, ",") {
		k, v, _ := strings.Cut(kv, ":")
		b[requestClass(t, d, k)] = duration(t, d, v)
	}
	return b
}

func requestClass(t *testing.T, d *datadriven.TestData, name string) RequestClass {
	if name == "" {
		return RequestRead
	}
	if c, ok := ParseRequestClass(name); ok {
		return c
	}
	d.Fatalf(t, "unknown request class %q", name)
	return 0
}

// targetsText is "<what> target D" when only GETs have a target (the transcripts
// before request classes), else "<what> targets get D, list D".
func targetsText(p *pacer, what string) string {
	only := true
	for _, cl := range p.pops {
		if cl.target > 0 && (cl.class != RequestRead || cl.member != "") {
			only = false
		}
	}
	if only {
		return fmt.Sprintf("%s target %s", what, p.ServingTarget(RequestRead))
	}
	return fmt.Sprintf("%s targets %s", what, p.servingTargets())
}

// classesText is "p99=D samples=N" when only GETs were judged, else each judged
// class's "get p99=D samples=N"; " over=K" follows when K of them were above
// the target, and " (slowed)" when that many are a slowdown.
func classesText(p *pacer, v pacerVerdict) string {
	var parts []string
	for c, cv := range v.Classes {
		if cv.Samples > 0 {
			parts = append(parts, fmt.Sprintf("%s %s", p.pops[c].name(), classText(cv)))
		}
	}
	if len(parts) == 1 && v.ServingClass == RequestRead && v.ServingMember == "" {
		return classText(v.Classes[RequestRead])
	}
	return strings.Join(parts, ", ")
}

func classText(cv classVerdict) string {
	s := fmt.Sprintf("p99=%s samples=%d", cv.P99, cv.Samples)
	if cv.Over > 0 {
		s += fmt.Sprintf(" over=%d", cv.Over)
	}
	if cv.Slowed {
		s += " (slowed)"
	}
	return s
}

func alarmText(s etcdSpace) string {
	switch {
	case s.Err != nil:
		return ", failed: " + s.Err.Error()
	case s.NoSpace:
		return ", NOSPACE alarm"
	}
	return ""
}

func rateText(r float64) string {
	if math.IsInf(r, 1) {
		return "unlimited"
	}
	return fmt.Sprintf("%.0f/s", r)
}

func duration(t *testing.T, d *datadriven.TestData, s string) time.Duration {
	if s == "" {
		return 0
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		d.Fatalf(t, "%v", err)
	}
	return v
}

func size(t *testing.T, d *datadriven.TestData, s string) int64 {
	if s == "" {
		return 0
	}
	q, err := resource.ParseQuantity(s)
	if err != nil {
		d.Fatalf(t, "size %q: %v", s, err)
	}
	return q.Value()
}
