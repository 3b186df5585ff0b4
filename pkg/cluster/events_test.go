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
	behind := parseMember(t, "self", "secrets: aesgcm/k1", now)
	ahead := parseMember(t, "b", "secrets: aesgcm/k2, aesgcm/k1", now)
	caughtUp := parseMember(t, "self", "secrets: aesgcm/k2, aesgcm/k1", now)
	conflicting := parseMember(t, "self", "secrets: aesgcm/k2#s9, aesgcm/k1", now)

	straggler := []string{"Warning EncryptionStraggler"}
	if got := step(behind, ahead); !slices.Equal(got, straggler) {
		t.Errorf("behind: %v, want %v", got, straggler)
	}
	if got := step(behind, ahead); len(got) != 0 {
		t.Errorf("still behind: %v, want nothing (reported once)", got)
	}
	if got := step(caughtUp, ahead); len(got) != 0 {
		t.Errorf("caught up: %v, want nothing", got)
	}
	if got := step(behind, ahead); !slices.Equal(got, straggler) {
		t.Errorf("behind again: %v, want %v", got, straggler)
	}
	conflict := []string{"Warning EncryptionKeyConflict"}
	if got := step(conflicting, ahead); !slices.Equal(got, conflict) {
		t.Errorf("conflict: %v, want %v", got, conflict)
	}
	if got := step(conflicting, ahead); len(got) != 0 {
		t.Errorf("same conflict: %v, want nothing", got)
	}
}
