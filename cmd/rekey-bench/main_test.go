package main

import (
	"testing"
	"time"
)

func TestParseDelayRange(t *testing.T) {
	lo, hi, err := parseDelayRange("500ms-60s")
	if err != nil || lo != 500*time.Millisecond || hi != time.Minute {
		t.Fatalf("500ms-60s: %v %v %v", lo, hi, err)
	}
	for _, bad := range []string{"60s", "5s-1s", "0s-0s", "x-5s", "-1s-5s"} {
		if _, _, err := parseDelayRange(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
