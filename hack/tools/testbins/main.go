// Command testbins builds the testbed's programs once into a directory: "servers" (the
// shim, the etcd wrapper, the KMS plugin and cmd/rekey) and "kube-apiserver"
// (dist/kube-apiserver and upstream's kube-apiserver of the same module graph). hack/test.sh runs it before its test groups
// and points them at the directory with testbed.PrebuiltEnv, so that groups running at
// once do not each build the same binaries (dist/kube-apiserver links all of
// k8s.io/kubernetes).
//
//	go run ./hack/tools/testbins DIR [servers] [kube-apiserver]   (default: both)
package main

import (
	"context"
	"fmt"
	"os"
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
		what = []string{"servers", "kube-apiserver"}
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		fail(err)
	}
	// Built here, whatever the environment says: this is what fills it.
	os.Unsetenv(testbed.PrebuiltEnv)
	ctx := context.Background()
	for _, w := range what {
		start := time.Now()
		switch w {
		case "servers":
			if _, err := testbed.Build(ctx, dir); err != nil {
				fail(err)
			}
			if _, err := testbed.BuildRekey(ctx, dir); err != nil {
				fail(err)
			}
			fmt.Printf("testbins: shim, etcd, KMS plugin and rekey in %v\n", time.Since(start).Round(time.Millisecond))
		case "kube-apiserver":
			if _, err := testbed.BuildKubeAPIServer(ctx, dir, true); err != nil {
				fail(err)
			}
			fmt.Printf("testbins: dist/kube-apiserver and upstream kube-apiserver in %v\n", time.Since(start).Round(time.Millisecond))
		default:
			fmt.Fprintf(os.Stderr, "testbins: unknown set %q: use servers or kube-apiserver\n", w)
			os.Exit(2)
		}
	}
}

func fail(err error) {
	fmt.Fprintln(os.Stderr, "testbins:", err)
	os.Exit(1)
}
