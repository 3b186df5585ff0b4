package bench

import (
	"io"
	"time"
)

// Settings control a whole harness run.
type Settings struct {
	// Short finishes the whole run in under about two minutes.
	Short bool
	// Rounds is how many alternating samples each implementation gets per case.
	Rounds int
	// SampleTime is the target duration of one sample.
	SampleTime time.Duration
	// Progress receives one line per finished case (nil: silent).
	Progress io.Writer
	// RotationObjects is the number of Secrets the rotation scenario rotates (default
	// 10,000; 1,000 in short mode).
	RotationObjects int
	// RotationSides are the rotation scenario's sides to run: rekey, upstream (default
	// both).
	RotationSides []string
	// RotationRekeyBin is the rekey binary side (a) runs (default: cmd/rekey built from
	// this tree).
	RotationRekeyBin string
}
