// Command kube-apiserver is upstream's kube-apiserver (k8s.io/kubernetes v1.37.2) with one
// change: its encryption-at-rest layer is rekey's reload agent. Every kube-apiserver flag
// keeps its meaning; --encryption-provider-config and
// --encryption-provider-config-automatic-reload are served by the agent, for every
// resource including custom resources and aggregated APIs. rekey's own flags (storage
// migration, cluster coordination, the layer switch) are listed under "Rekey flags" in
// --help; pkg/layer declares them (and the shim's) and wires them, so the two agree.
//
// The copied part of upstream's command code is in upstream.go; the wiring of the agent
// in rekey.go. See docs/kube-apiserver.md.
package main

import (
	"os"

	"k8s.io/component-base/cli"
)

// rekeyVersion is stamped by `make kube-apiserver` (-X main.rekeyVersion=...).
var rekeyVersion = "devel"

func main() {
	os.Exit(cli.Run(newAPIServerCommand()))
}
