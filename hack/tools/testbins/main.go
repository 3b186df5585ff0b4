// Command testbins builds the testbed's programs once into a directory: "servers" (the
// shim, the etcd wrapper, the KMS plugin and cmd/rekey) and "kube-apiserver"
// (dist/kube-apiserver and upstream's kube-apiserver of the same module graph), marking
// each ready as it is built (testbed.ReadyMarker) and the whole as done at the end
// (testbed.DoneMarker). hack/test.sh runs it beside its test groups and points them at
// the directory with testbed.PrebuiltEnv, so that groups running at once wait for one
// build of each set instead of each building it (dist/kube-apiserver links all of
// k8s.io/kubernetes).
//
//	go run ./hack/tools/testbins DIR [servers] [kube-apiserver]   (default: both)
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: testbins DIR [servers] [kube-apiserver]")
		os.Exit(2)
	}
	dir, what := os.Args[1], os.Args[2:]
	if len(what) == 0 {
		what = []string{testbed.PrebuiltServers, testbed.PrebuiltKubeAPIServer}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fail(dir, err)
	}
	// Built here, whatever the environment says: this is what fills it.
	os.Unsetenv(testbed.PrebuiltEnv)
	ctx := context.Background()
	for _, w := range what {
		start := time.Now()
		var err error
		switch w {
		case testbed.PrebuiltServers:
			if _, err = testbed.Build(ctx, dir); err == nil {
				_, err = testbed.BuildRekey(ctx, dir)
			}
		case testbed.PrebuiltKubeAPIServer:
			_, err = testbed.BuildKubeAPIServer(ctx, dir, true)
		default:
			err = fmt.Errorf("unknown set %q: use %s or %s", w, testbed.PrebuiltServers, testbed.PrebuiltKubeAPIServer)
		}
		if err != nil {
			fail(dir, err)
		}
		// The tests waiting for this set take it from here on.
		if err := os.WriteFile(filepath.Join(dir, testbed.ReadyMarker(w)), nil, 0o644); err != nil {
			fail(dir, err)
		}
		fmt.Printf("testbins: %s in %v\n", w, time.Since(start).Round(time.Millisecond))
	}
	done(dir)
}

// done marks the prebuild as ended: a test still waiting for a set builds it itself.
func done(dir string) {
	_ = os.WriteFile(filepath.Join(dir, testbed.DoneMarker), nil, 0o644)
}

func fail(dir string, err error) {
	done(dir)
	fmt.Fprintln(os.Stderr, "testbins:", err)
	os.Exit(1)
}
