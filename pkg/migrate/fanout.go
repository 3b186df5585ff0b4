package migrate

import (
	"errors"
	"sync"
)

// fanOut splits [0, n) into at most workers contiguous chunks of equal size (the last
// may be shorter), runs fn on each in its own goroutine and returns when all are done,
// with every chunk's error joined. Chunks keep their order, so fn may write results
// into a slice by index without locking.
func fanOut(n, workers int, fn func(lo, hi int) error) error {
	if n <= 0 {
		return nil
	}
	workers = min(max(workers, 1), n)
	chunk := (n + workers - 1) / workers
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := w*chunk, min((w+1)*chunk, n)
		if lo >= hi {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = fn(lo, hi)
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}
