package migrate

import (
	"errors"
	"fmt"
	"sync/atomic"
	"testing"
)

// TestFanOutCoversEveryIndexOnceAndJoinsErrors: every index of [0, n) is handed to
// exactly one chunk, never more chunks than workers or items, and every chunk's error
// comes back.
func TestFanOutCoversEveryIndexOnceAndJoinsErrors(t *testing.T) {
	for _, tc := range []struct{ n, workers int }{{0, 4}, {1, 4}, {7, 3}, {64, 64}, {65, 8}, {10, 0}, {5, 100}} {
		seen := make([]atomic.Int32, tc.n)
		var chunks atomic.Int32
		err := fanOut(tc.n, tc.workers, func(lo, hi int) error {
			chunks.Add(1)
			for i := lo; i < hi; i++ {
				seen[i].Add(1)
			}
			return fmt.Errorf("chunk %d-%d", lo, hi)
		})
		for i := range seen {
			if c := seen[i].Load(); c != 1 {
				t.Fatalf("n=%d workers=%d: index %d handled %d times", tc.n, tc.workers, i, c)
			}
		}
		if c := int(chunks.Load()); c > max(tc.workers, 1) || c > tc.n {
			t.Fatalf("n=%d workers=%d: %d chunks", tc.n, tc.workers, c)
		}
		var joined interface{ Unwrap() []error }
		if tc.n == 0 {
			if err != nil {
				t.Fatalf("no items: %v", err)
			}
		} else if !errors.As(err, &joined) || len(joined.Unwrap()) != int(chunks.Load()) {
			t.Fatalf("n=%d workers=%d: error %v does not join every chunk's error", tc.n, tc.workers, err)
		}
	}
}
