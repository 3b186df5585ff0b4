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

// An entry nobody writes with that this apiserver has with another check value is a
// warning event once per episode, however the members on each side change: rolling a
// KMS v1 socket path node by node is one episode.
func TestNodeEventsReadOnlyConflict(t *testing.T) {
	now := time.Unix(1000, 0)
	var e nodeEvents
	step := func(members ...MemberState) []string {
		var out []string
		for _, ev := range e.step("self", members) {
			out = append(out, fmt.Sprintf("%s %s: %s", ev.kind, ev.reason, ev.message))
		}
		return out
	}
	on := func(id, endpoint string) MemberState {
		return parseMember(t, id, "secrets: *aesgcm/k1, kmsv1/old#"+endpoint, now)
	}
	want := []string{"Warning EncryptionKeyConflict: secrets: kmsv1/old has 2 endpoints: check e1 on b,c; check e2 on self (read only, so readiness does not depend on it; make sure every endpoint reaches a plugin with the same key)"}
	if got := step(on("self", "e2"), on("b", "e1"), on("c", "e1")); !slices.Equal(got, want) {
		t.Errorf("self moved: %q, want %q", got, want)
	}
	if got := step(on("self", "e2"), on("b", "e2"), on("c", "e1")); len(got) != 0 {
		t.Errorf("b moved too: %q, want nothing (one episode)", got)
	}
	if got := step(on("self", "e2"), on("b", "e2"), on("c", "e2")); len(got) != 0 {
		t.Errorf("all moved: %q, want nothing", got)
	}
	want = []string{"Warning EncryptionKeyConflict: secrets: kmsv1/old has 2 endpoints: check e1 on self; check e2 on b,c (read only, so readiness does not depend on it; make sure every endpoint reaches a plugin with the same key)"}
	if got := step(on("self", "e1"), on("b", "e2"), on("c", "e2")); !slices.Equal(got, want) {
		t.Errorf("self back on e1: %q, want %q", got, want)
	}
	// Members that differ over an entry this apiserver does not have: not its event.
	e = nodeEvents{}
	if got := step(parseMember(t, "self", "secrets: *aesgcm/k1", now), on("b", "e1"), on("c", "e2")); len(got) != 0 {
		t.Errorf("only b and c have it: %q, want nothing", got)
	}
}
