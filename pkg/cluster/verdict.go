package cluster

import (
	"fmt"
	"slices"
	"strings"
	"time"
)

// Verdict sums up the cluster for `rekey status` and the status document.
type Verdict struct {
	// Converged: every live member writes every resource with the same key, no key is
	// held back, and no migration is running or due.
	Converged bool `json:"converged"`
	// Summary is one line: "converged", "promoting K for R, waiting for ids",
	// "members disagree: …", "migrating R x/y", or "conflict: …" (one key name, two
	// secrets), prefixed by "alarm: " when members have
	// disagreed for longer than the alarm threshold.
	Summary string `json:"summary"`
	// Disagreement says which write keys differ or are held ("" when none).
	Disagreement string `json:"disagreement,omitempty"`
	// Conflicts lists keys that members have under one name with different secrets
	// and that a live member writes with; the summary then starts with "conflict: "
	// and the cluster is not converged.
	Conflicts []Conflict `json:"conflicts,omitempty"`
	// Warnings describe entries that members have with different check values but
	// nobody writes with (read-only keys, every KMS v1 provider: splitConflicts). They
	// leave the summary, convergence, the alarm and readiness alone: nothing written
	// from now on depends on them, and a KMS v1 socket path rolled node by node would
	// otherwise count as a conflict for the whole roll.
	Warnings []string `json:"warnings,omitempty"`
	// Alarm is set when a member reports disagreeing for longer than the threshold.
	Alarm   bool `json:"alarm"`
	Members int  `json:"members"`
}

// Evaluate judges the live members and the migration state (nil when unknown) at now.
func Evaluate(members []MemberState, mig *MigrationState, now time.Time, alarmAfter time.Duration) Verdict {
	v := Verdict{Members: len(members)}
	if len(members) == 0 {
		v.Summary = "no live apiserver publishes its state"
		return v
	}
	byID := map[string]MemberState{}
	resources := []string{}
	for _, m := range members {
		byID[m.APIServerID] = m
		for _, r := range m.Resources {
			if !slices.Contains(resources, r.Resource) {
				resources = append(resources, r.Resource)
			}
		}
		if !m.DisagreeingSince.IsZero() && now.Sub(m.DisagreeingSince) > alarmAfter {
			v.Alarm = true
		}
	}
	promoting, disagree := promotions(members), []string(nil)
	for _, r := range resources {
		if _, ok, why := CommonWriteKey(byID, r); !ok {
			disagree = append(disagree, r+": "+why)
		}
	}
	var readOnly []Conflict
	v.Conflicts, readOnly = splitConflicts(members)
	for _, c := range readOnly {
		v.Warnings = append(v.Warnings, c.readOnlyWarning())
	}
	var conflicts []string
	for _, c := range v.Conflicts {
		conflicts = append(conflicts, c.String())
	}
	v.Disagreement = strings.Join(slices.Concat(conflicts, promoting, disagree), "; ")
	migrating := migrations(mig)
	switch {
	case len(conflicts) > 0:
		v.Summary = "conflict: " + strings.Join(conflicts, "; ")
	case len(promoting) > 0:
		v.Summary = strings.Join(promoting, "; ")
	case len(disagree) > 0:
		v.Summary = "members disagree: " + strings.Join(disagree, "; ")
	case len(migrating) > 0:
		v.Summary = strings.Join(migrating, "; ")
	default:
		v.Summary, v.Converged = "converged", true
	}
	if v.Alarm {
		v.Converged = false
		v.Summary = "alarm: " + v.Summary
	}
	return v
}

// promotions describes every write key a member holds back, and whom it waits for.
func promotions(members []MemberState) []string {
	var promoting []string
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Held == nil {
				continue
			}
			var waiting []string
			if held, ok := heldKeyID(r); ok {
				waiting = keyIDWaitingFor(members, m.APIServerID, held.Key, held.KeyIDHash)
			} else {
				for _, o := range members {
					if !o.CanRead(r.Resource, *r.Held) {
						waiting = append(waiting, o.APIServerID)
					}
				}
			}
			p := fmt.Sprintf("promoting %s for %s on %s, waiting for %s", r.Held, r.Resource, m.APIServerID, strings.Join(waiting, ","))
			if len(waiting) == 0 {
				p = fmt.Sprintf("promoting %s for %s on %s", r.Held, r.Resource, m.APIServerID)
			}
			promoting = append(promoting, p)
		}
	}
	return promoting
}

// migrations describes the running and due migrations of mig (nil: unknown).
func migrations(mig *MigrationState) []string {
	var migrating []string
	if mig != nil {
		if mig.Running != nil {
			s := "migrating " + mig.Running.Resource + " to " + mig.Running.Target.String()
			if p := mig.Progress; p != nil && p.Resource == mig.Running.Resource {
				s += fmt.Sprintf(" %d/%d", p.Done, p.Total)
				if p.ETA > 0 {
					s += fmt.Sprintf(" (ETA %s)", p.ETA.Round(time.Second))
				}
			}
			migrating = append(migrating, s)
		}
		for _, p := range mig.Plans {
			if p.State == PlanMigrate || p.State == PlanRetrying {
				migrating = append(migrating, fmt.Sprintf("migration of %s to %s %s", p.Resource, p.Target, p.State))
			}
		}
	}
	return migrating
}
