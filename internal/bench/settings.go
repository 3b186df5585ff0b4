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
	// RotationOpsDir, when set, receives each side's client requests as
	// <side>-client-ops.csv (answered at, window, requests, latency), to read the
	// clients' latency second by second against the shims' logs.
	RotationOpsDir string
	// RotationShimFlags are more flags for the rekey side's shims (e.g.
	// --storage-migration-priority=fast, to measure what a priority trades).
	RotationShimFlags []string
	// ScaleObjects is the number of Secrets the scale scenario stores and rotates
	// (default 1,000,000; 20,000 in short mode).
	ScaleObjects int
	// ScaleSides are the scale scenario's sides to run: rekey, upstream (default both;
	// rekey alone in short mode).
	ScaleSides []string
	// ScaleBaseline is the client workload's window before the rotation (default 1
	// minute; 10 s in short mode).
	ScaleBaseline time.Duration
	// ScaleUpstreamLimit bounds the upstream side's replace of every Secret (default
	// 20 minutes); one cut short reports its rate and an extrapolated time.
	ScaleUpstreamLimit time.Duration
	// ScaleMigrationRate is the rekey side's --storage-migration-rate in objects/s (0:
	// the shim's default, unlimited).
	ScaleMigrationRate float64
	// ScaleQuotaBytes is the scale scenario's etcd --quota-backend-bytes (0: 2 GiB, the
	// default); the rekey side's shim is told it.
	ScaleQuotaBytes int64
	// ScaleShimFlags are more flags for the rekey side's shim (e.g. -v=2 to see
	// the pacing's decisions).
	ScaleShimFlags []string
	// ScaleIdle runs the scale scenario without its client workload: the migration's
	// speed on an idle cluster.
	ScaleIdle bool
	// ScaleOpsDir, when set, receives each side's client requests as
	// <side>-client-ops.csv (start, latency, failed) with the rotation's moments, to
	// line the clients' latency up with what else was measured at the time.
	ScaleOpsDir string
	// ControllerObjects is the number of Secrets the controller scenario rotates
	// (default 10,000; 300 in short mode).
	ControllerObjects int
	// ControllerMinDelay and ControllerMaxDelay bound each hosted apiserver's
	// projection delay of the configuration Secret (default 0–60 s; 0–5 s in short
	// mode); ControllerSeed seeds them (0: from the clock, reported either way).
	ControllerMinDelay, ControllerMaxDelay time.Duration
	ControllerSeed                         uint64
	// ControllerSides are the controller scenario's sides to run: rekey, gardener
	// (default both).
	ControllerSides []string
}
