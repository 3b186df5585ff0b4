package cluster

import (
	"fmt"
	"slices"
	"testing"
	"time"
)

// nodeEvents reports a straggling resource and a key conflict once per episode.
func TestNodeEventsOncePerEpisode(t *testing.T) {
	now := time.Unix(1000, 0)
	var e nodeEvents
	step := func(members ...MemberState) []string {
		var out []string
		for _, ev := range e.step("self", members) {
			out = append(out, fmt.Sprintf("%s %s", ev.kind, ev.reason))
		}
		return out
	}
	// b and c moved on to k2 and read each other; self writes k1 and cannot read k2.
	behind := parseMember(t, "self", "secrets: aesgcm/k1", now)
	b := parseMember(t, "b", "secrets: aesgcm/k2", now)
	c := parseMember(t, "c", "secrets: aesgcm/k2", now)
	caughtUp := parseMember(t, "self", "secrets: aesgcm/k2, aesgcm/k1", now)
	conflicting := parseMember(t, "self", "secrets: aesgcm/k2#s9, aesgcm/k1", now)

	straggler := []string{"Warning EncryptionStraggler"}
	if got := step(behind, b, c); !slices.Equal(got, straggler) {
		t.Errorf("behind: %v, want %v", got, straggler)
	}
	if got := step(behind, b, c); len(got) != 0 {
		t.Errorf("still behind: %v, want nothing (reported once)", got)
	}
	if got := step(caughtUp, b, c); len(got) != 0 {
		t.Errorf("caught up: %v, want nothing", got)
	}
	if got := step(behind, b, c); !slices.Equal(got, straggler) {
		t.Errorf("behind again: %v, want %v", got, straggler)
	}
	conflict := []string{"Warning EncryptionKeyConflict"}
	if got := step(conflicting, b, c); !slices.Equal(got, conflict) {
		t.Errorf("conflict: %v, want %v", got, conflict)
	}
	if got := step(conflicting, b, c); len(got) != 0 {
		t.Errorf("same conflict: %v, want nothing", got)
	}
}
