package cluster

import (
	"context"
	"fmt"

	"github.com/rekey-io/rekey/pkg/events"
)

// MigrationMirror is told of each migration the elected leader runs, so that a
// binary can mirror it where Kubernetes tooling looks (dist/kube-apiserver: a
// storagemigration.k8s.io StorageVersionMigration). It is called on the migration's
// own goroutine, Started before the migration and Finished after it (err nil when it
// was verified), so a slow API delays only that migration; it should bound its calls.
type MigrationMirror interface {
	Started(ctx context.Context, resource, target string)
	Finished(ctx context.Context, resource string, err error)
}

// nodeEvents turns what Node.evaluate sees each tick into events on changes only:
// this apiserver starting to straggle for a resource, a key conflict involving it
// appearing, an entry nobody writes with that it has with another check value than
// another member (readiness lets that pass, so the event is how it gets noticed). A
// fact that goes on is reported once; one that ends and comes back is reported again.
type nodeEvents struct {
	straggling map[string]bool
	conflicts  map[string]bool
	// readOnly is keyed by resource and entry, not by the members on each side: a
	// socket path rolled node by node changes those sides at every step and is one
	// episode.
	readOnly map[string]bool
}

// step returns the events for the members as they are now (self included).
func (e *nodeEvents) step(self string, members []MemberState) []event {
	var out []event
	straggling := map[string]bool{}
	for _, m := range members {
		if m.APIServerID != self {
			continue
		}
		for _, r := range m.Resources {
			if straggles(members, m, r.Resource) {
				straggling[r.Resource] = true
				if !e.straggling[r.Resource] {
					out = append(out, event{events.Warning, events.ReasonStraggler, fmt.Sprintf(
						"%s: this apiserver cannot read the key the other apiservers write with; it refuses writes and is not ready until its configuration has that key", r.Resource)})
				}
			}
		}
	}
	written, readOnlyConflicts := splitConflicts(members)
	readOnly := map[string]bool{}
	for _, c := range readOnlyConflicts {
		if !c.involves(self) {
			continue
		}
		id := c.Resource + " " + c.Key.String()
		readOnly[id] = true
		if !e.readOnly[id] {
			out = append(out, event{events.Warning, events.ReasonKeyConflict, c.readOnlyWarning()})
		}
	}
	conflicts := map[string]bool{}
	for _, c := range written {
		if !c.involves(self) {
			continue
		}
		s := c.String()
		conflicts[s] = true
		if !e.conflicts[s] {
			out = append(out, event{events.Warning, events.ReasonKeyConflict,
				s + ": give one of the secrets another key name, or the same secret on every apiserver"})
		}
	}
	e.straggling, e.conflicts, e.readOnly = straggling, conflicts, readOnly
	return out
}

type event struct {
	kind            events.Kind
	reason, message string
}
