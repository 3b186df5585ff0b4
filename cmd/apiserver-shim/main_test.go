package main

import (
	"testing"

	"github.com/spf13/pflag"
	utilfeature "k8s.io/apiserver/pkg/util/feature"
	logsapi "k8s.io/component-base/logs/api/v1"
	"k8s.io/component-base/version/verflag"

	"github.com/rekey-io/rekey/internal/layertest"
	"github.com/rekey-io/rekey/pkg/layer"
)

// shimOwnFlags are the shim's flags that are not the encryption layer's: kube-apiserver
// has each of them itself (or, for the embedded etcd and --port-file, has no such
// thing), so dist/kube-apiserver takes them from upstream. Logging and --version flags
// come from component-base and are not listed.
var shimOwnFlags = []string{
	"encryption-provider-config", "encryption-provider-config-automatic-reload",
	"etcd-servers", "etcd-cafile", "etcd-certfile", "etcd-keyfile", "etcd-prefix", "etcd-connect-timeout",
	"data-dir", "etcd-unsafe-no-fsync", "etcd-log-level",
	"bind-address", "secure-port", "cert-dir", "port-file",
	"token-auth-file",
}

// Every flag of the shim is either its own (listed above, or component-base's logging
// and version flags) or pkg/layer's, declared with layer.ShimDefaults: same names,
// types, defaults, help and hidden-ness, none more, none fewer. dist/kube-apiserver's
// TestRekeyFlagsAreTheLayers holds kube-apiserver to the same and compares the two
// binaries; a flag added to one binary alone fails there or here.
func TestRekeyFlagsAreTheLayers(t *testing.T) {
	own := map[string]bool{"help": true}
	for _, name := range shimOwnFlags {
		own[name] = true
	}
	// newCommand first: adding the feature gates' flag closes the process's gate.
	shimFlags := newCommand().Flags()
	// As newCommand adds them.
	componentBase := pflag.NewFlagSet("component-base", pflag.ContinueOnError)
	logsapi.AddFlags(logsapi.NewLoggingConfiguration(), componentBase)
	verflag.AddFlags(componentBase)
	utilfeature.DefaultMutableFeatureGate.AddFlag(componentBase)

	rekey := pflag.NewFlagSet("rekey", pflag.ContinueOnError)
	shimFlags.VisitAll(func(f *pflag.Flag) {
		if !own[f.Name] && componentBase.Lookup(f.Name) == nil {
			rekey.AddFlag(f)
		}
	})
	for _, d := range layertest.Diff(rekey, layertest.Declared(layer.ShimDefaults())) {
		t.Errorf("apiserver-shim vs pkg/layer with ShimDefaults: %s (a flag of the shim's own belongs in shimOwnFlags, with a reason kube-apiserver does not need it from pkg/layer)", d)
	}
}
