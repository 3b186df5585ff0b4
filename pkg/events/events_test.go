package events

import (
	"fmt"
	"slices"
	"testing"
)

type recorded []string

func (r *recorded) Event(kind Kind, reason, message string) {
	*r = append(*r, fmt.Sprintf("%s %s %s", kind, reason, message))
}

func TestDeferredBuffersBoundedlyThenForwards(t *testing.T) {
	d := &Deferred{Max: 2}
	d.Event(Normal, "A", "1")
	d.Event(Warning, "B", "2")
	d.Event(Normal, "C", "3") // over Max: dropped
	var got recorded
	if dropped := d.Attach(&got); dropped != 1 {
		t.Errorf("dropped = %d, want 1", dropped)
	}
	d.Event(Normal, "D", "4")
	want := recorded{"Normal A 1", "Warning B 2", "Normal D 4"}
	if !slices.Equal(got, want) {
		t.Errorf("events = %q, want %q", got, want)
	}
	d.Attach(nil)
	d.Event(Normal, "E", "5")
	if len(got) != 3 {
		t.Errorf("a detached Deferred forwarded: %q", got)
	}
}

func TestOrNop(t *testing.T) {
	OrNop(nil).Event(Normal, "R", "m") // must not panic
	var r recorded
	OrNop(&r).Event(Normal, "R", "m")
	if len(r) != 1 {
		t.Errorf("OrNop replaced a non-nil sink")
	}
}
