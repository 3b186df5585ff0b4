package freeport

import (
	"net"
	"strconv"
	"testing"
)

// Picks stay below the ephemeral range (where outgoing connections take their local
// ports) and are bindable.
func TestPickIsBelowTheEphemeralRangeAndFree(t *testing.T) {
	lo := ephemeralLow()
	ports, err := PickN(50)
	if err != nil {
		t.Fatal(err)
	}
	seen := map[int]bool{}
	for _, p := range ports {
		if seen[p] {
			t.Fatalf("PickN returned %d twice", p)
		}
		seen[p] = true
		if lo-below >= 1000 && (p < below || p >= lo) {
			t.Fatalf("port %d outside [%d, %d)", p, below, lo)
		}
		l, err := net.Listen("tcp", net.JoinHostPort("127.0.0.1", strconv.Itoa(p)))
		if err != nil {
			t.Fatalf("picked port %d is not bindable: %v", p, err)
		}
		_ = l.Close()
	}
}
