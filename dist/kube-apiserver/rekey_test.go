package main

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/spf13/pflag"
	"k8s.io/component-base/cli/globalflag"
	"k8s.io/component-base/logs"
	"k8s.io/component-base/metrics"
	"k8s.io/component-base/version/verflag"
	"k8s.io/kubernetes/cmd/kube-apiserver/app/options"

	"github.com/rekey-io/rekey/internal/layertest"
	rekeylayer "github.com/rekey-io/rekey/pkg/layer"
)

// Upstream's encryption families come from the legacy registry only when rekey does
// not serve them; a name rekey serves appears once; the rest of the legacy registry
// stays.
func TestMergedGathererEachNameOnce(t *testing.T) {
	legacy := prometheus.NewRegistry()
	for _, name := range []string{
		"apiserver_storage_transformation_operations_total",    // upstream's, also served by rekey
		"apiserver_envelope_encryption_dek_cache_fill_percent", // upstream's, not served by rekey
		"apiserver_request_total",                              // kube-apiserver's own
	} {
		c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: "legacy " + name})
		c.Inc()
		legacy.MustRegister(c)
	}
	rekey := metrics.NewKubeRegistry()
	ours := metrics.NewCounter(&metrics.CounterOpts{Name: "apiserver_storage_transformation_operations_total", Help: "rekey's"})
	rekey.MustRegister(ours)
	ours.Inc()

	mfs, err := mergedGatherer{rekey: rekey, legacy: legacy}.Gather()
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]string{}
	for _, mf := range mfs {
		if _, dup := got[mf.GetName()]; dup {
			t.Errorf("%s gathered twice", mf.GetName())
		}
		got[mf.GetName()] = mf.GetHelp()
	}
	if h := got["apiserver_storage_transformation_operations_total"]; !strings.Contains(h, "rekey's") {
		t.Errorf("transformation operations served from %q, want rekey's registry", h)
	}
	if _, ok := got["apiserver_envelope_encryption_dek_cache_fill_percent"]; ok {
		t.Error("an upstream encryption family that no code here updates is served")
	}
	if _, ok := got["apiserver_request_total"]; !ok {
		t.Error("kube-apiserver's own metrics are missing")
	}
}

// The flags this binary adds to upstream's kube-apiserver are pkg/layer's, declared with
// layer.KubeAPIServerDefaults: same names, types, defaults, help and hidden-ness, none
// more, none fewer. The apiserver shim's are pkg/layer's with layer.ShimDefaults
// (cmd/apiserver-shim's TestRekeyFlagsAreTheLayers holds the shim to that), and the two
// binaries differ only where layer.Defaults says. A flag added to one binary alone
// fails here or in the shim's test.
func TestRekeyFlagsAreTheLayers(t *testing.T) {
	// newAPIServerCommand sets up the process's signal handler, which panics the second
	// time: no other test of this package may call it.
	cmd := newAPIServerCommand()
	upstream := upstreamFlags()
	added := pflag.NewFlagSet("added", pflag.ContinueOnError)
	cmd.Flags().VisitAll(func(f *pflag.Flag) {
		if upstream.Lookup(f.Name) == nil {
			added.AddFlag(f)
		}
	})
	if !added.HasFlags() {
		t.Fatal("no flag added to upstream's: the comparison would prove nothing")
	}
	for _, d := range layertest.Diff(added, layertest.Declared(rekeylayer.KubeAPIServerDefaults())) {
		t.Errorf("kube-apiserver vs pkg/layer with KubeAPIServerDefaults: %s", d)
	}

	documented := map[string]string{
		rekeylayer.FlagStorageMigrationResources: layertest.OnlyInGot,
		rekeylayer.FlagAPIServerID:               layertest.Help,
	}
	seen := map[string]string{}
	for _, d := range layertest.Diff(added, layertest.Declared(rekeylayer.ShimDefaults())) {
		seen[d.Flag] = d.Aspect
		if documented[d.Flag] != d.Aspect {
			t.Errorf("kube-apiserver vs apiserver-shim, not a documented difference (layer.Defaults): %s", d)
		}
	}
	for flag, aspect := range documented {
		if seen[flag] != aspect {
			t.Errorf("--%s: documented to differ between the binaries in its %s, but does not: update layer.Defaults and this list", flag, aspect)
		}
	}
}

// upstreamFlags are the flags of upstream's kube-apiserver command, assembled as
// newAPIServerCommand assembles them without the lines marked rekey.
func upstreamFlags() *pflag.FlagSet {
	nfs := options.NewServerRunOptions().Flags()
	verflag.AddFlags(nfs.FlagSet("global"))
	globalflag.AddGlobalFlags(nfs.FlagSet("global"), "kube-apiserver", logs.SkipLoggingConfigurationFlags())
	fs := pflag.NewFlagSet("upstream", pflag.ContinueOnError)
	for _, f := range nfs.FlagSets {
		fs.AddFlagSet(f)
	}
	return fs
}
