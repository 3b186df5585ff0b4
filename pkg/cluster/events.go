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
// appearing. A fact that goes on is reported once; one that ends and comes back is
// reported again.
type nodeEvents struct {
	straggling map[string]bool
	conflicts  map[string]bool
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
	conflicts := map[string]bool{}
	for _, c := range keyConflicts(members) {
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
	e.straggling, e.conflicts = straggling, conflicts
	return out
}

type event struct {
	kind            events.Kind
	reason, message string
}
