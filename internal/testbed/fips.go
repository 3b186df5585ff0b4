package testbed

import (
	"crypto/fips140"
	"os"

	"github.com/rekey-io/rekey/internal/fipsenv"
)

// FIPSModule is the Go FIPS 140-3 module version the testbed builds its programs with in
// FIPS mode: $REKEY_TESTBED_GOFIPS140, else $GOFIPS140 when it names one, else v1.0.0.
func FIPSModule() string {
	if v := os.Getenv("REKEY_TESTBED_GOFIPS140"); v != "" {
		return v
	}
	if v := os.Getenv("GOFIPS140"); v != "" && v != "off" {
		return v
	}
	return "v1.0.0"
}

// FIPSEnv, set to 1, runs the testbed's programs in FIPS 140-3 mode, enforced, from a
// test process that is not in FIPS mode itself (make test-fips runs the e2e package so:
// its checks read stored values with upstream's transformers, which cannot run under
// fips140=only).
const FIPSEnv = "REKEY_TESTBED_FIPS"

// FIPS reports whether the testbed runs in FIPS 140-3 mode, enforced: $REKEY_TESTBED_FIPS
// is 1, or the test process itself runs under GODEBUG=fips140=only. Then rekey's programs (the
// shim, the KMS plugin, the rekey CLI) are built with GOFIPS140=FIPSModule() and run
// with GODEBUG=fips140=only, and etcd, a fixture that cannot run in that mode (it
// computes member ids with SHA-1), is built without the module and runs with
// fips140=off.
func FIPS() bool { return os.Getenv(FIPSEnv) == "1" || fips140.Enforced() }

// BuildEnv is the environment of `go build` for rekey's programs: GOFIPS140=FIPSModule()
// in FIPS mode, the test's environment otherwise.
func BuildEnv() []string {
	if FIPS() {
		return append(os.Environ(), "GOFIPS140="+FIPSModule())
	}
	return os.Environ()
}

// fixtureBuildEnv is the environment of `go build` for a fixture that runs outside FIPS
// mode (etcd): no FIPS module.
func fixtureBuildEnv() []string { return append(os.Environ(), "GOFIPS140=off") }

// RunEnv is the environment rekey's programs run with: GODEBUG=fips140=only in FIPS
// mode, the test's environment otherwise.
func RunEnv() []string {
	if FIPS() {
		return fipsenv.WithGODEBUG(os.Environ(), "only")
	}
	return os.Environ()
}

// fixtureRunEnv is the environment of etcd: fips140=off in FIPS mode.
func fixtureRunEnv() []string {
	if FIPS() {
		return fipsenv.WithGODEBUG(os.Environ(), "off")
	}
	return os.Environ()
}
