package cluster

import "time"

// disagreementAlarm is one apiserver's disagreement alarm, a pure state machine in the
// fence's shape, fed the fence's events: the live members (this apiserver's own state
// as it is now among them, not as last published) and clock ticks.
//
// Rule: the members disagree while Evaluate finds a write key that differs between
// them or is held back. The disagreement's start is the clock at the first event that
// found it, kept while it lasts (so every member publishes it and `rekey status` can
// raise the alarm from any of them); the alarm is raised once it has lasted longer than
// the threshold — at once when a key name has two secrets (keyConflicts), which waiting
// never resolves — and both clear with the first event that finds the members agreeing.
type disagreementAlarm struct {
	threshold time.Duration
	now       time.Time
	since     time.Time // zero while the members agree
	detail    string
	conflict  bool
	raised    bool
}

func newDisagreementAlarm(threshold time.Duration, now time.Time) *disagreementAlarm {
	return &disagreementAlarm{threshold: threshold, now: now}
}

// Step feeds one event.
func (a *disagreementAlarm) Step(ev fenceEvent) {
	switch e := ev.(type) {
	case membersChanged:
		v := Evaluate(e.Members, nil, a.now, a.threshold)
		a.detail, a.conflict = v.Disagreement, len(v.Conflicts) > 0
		if a.detail == "" {
			a.since = time.Time{}
		} else if a.since.IsZero() {
			a.since = a.now
		}
	case tick:
		if e.Now.After(a.now) {
			a.now = e.Now
		}
	}
	// A key name with two secrets never resolves by waiting: it raises the alarm at once.
	a.raised = !a.since.IsZero() && (a.conflict || a.now.Sub(a.since) > a.threshold)
}

// Since is when the members started to disagree (zero while they agree).
func (a *disagreementAlarm) Since() time.Time { return a.since }

// Raised reports whether the disagreement has lasted longer than the threshold.
func (a *disagreementAlarm) Raised() bool { return a.raised }

// Detail says which write keys differ or are held ("" while the members agree).
func (a *disagreementAlarm) Detail() string { return a.detail }
