//go:build race

package migrate

// raceDetector is true in a -race build: its shadow memory multiplies the heap figures
// a memory-bound test measures, and its slowdown stretches a run of 500 MiB to minutes.
const raceDetector = true
