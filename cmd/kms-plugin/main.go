// Command kms-plugin is a local KMS v2 plugin for tests, the testbed and benchmarks.
// See docs/kms-plugin.md.
package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"os/signal"
	"strings"
	"syscall"

	"github.com/rekey-io/rekey/internal/kmsplugin"
)

func main() {
	var o kmsplugin.Options
	flag.StringVar(&o.ListenAddr, "listen-addr", "", "gRPC socket: unix:///path.sock (its directory must be private: not a symlink, ours or root's, not group/world-writable) or unix:///@abstract-name (default "+kmsplugin.DefaultListenAddr()+", directory created 0700)")
	flag.StringVar(&o.KeysFile, "keys-file", "", "YAML or JSON file `keys: [{name: <key id>, secret: <base64 of 32 bytes>}]`; the first key is active; edits rotate")
	flag.StringVar(&o.ControlAddr, "control-addr", "", "fault-injection API: unix:///path.sock or 127.0.0.1:port (empty: disabled)")
	flag.StringVar(&o.APIVersion, "api-version", "v2", "KMS API to serve: v2, or v1 (k8s.io/kms/apis/v1beta1) for KMS v1 data that rekey reads and migrates off")
	faults := flag.String("faults", "", "faults document (JSON, as the control API's PUT /faults takes) active from the start: a fault about the first calls after a start (startupFlap) needs it")
	flag.Parse()
	if *faults != "" {
		f, err := kmsplugin.DecodeFaults(strings.NewReader(*faults))
		if err != nil {
			fmt.Fprintf(os.Stderr, "kms-plugin: --faults: %v (see docs/kms-plugin.md for the faults document)\n", err)
			os.Exit(2)
		}
		o.Faults = f
	}
	if o.KeysFile == "" {
		fmt.Fprintln(os.Stderr, "kms-plugin: --keys-file is required")
		os.Exit(2)
	}
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := kmsplugin.Run(ctx, o); err != nil {
		fmt.Fprintln(os.Stderr, err)
		os.Exit(1)
	}
}
