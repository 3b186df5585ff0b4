package main

import (
	"strings"
	"testing"

	"github.com/prometheus/client_golang/prometheus"
	"k8s.io/component-base/metrics"
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

func TestRekeyOptionsValidate(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(*rekeyOptions)
		want   string
	}{
		{"defaults", func(*rekeyOptions) {}, ""},
		{"unknown layer", func(o *rekeyOptions) { o.Layer = "other" }, `--encryption-layer="other"`},
		{"migration on upstream's layer", func(o *rekeyOptions) { o.Layer, o.StorageMigration = layerUpstream, true }, "--storage-migration needs --encryption-layer=rekey"},
		{"negative rate", func(o *rekeyOptions) { o.StorageMigrationRate = -1 }, "--storage-migration-rate"},
		{"wildcard resource", func(o *rekeyOptions) { o.StorageResources = []string{"*.example.com"} }, "wildcards cannot be scanned"},
		{"apiserver id with a slash", func(o *rekeyOptions) { o.APIServerID = "node/a" }, "--apiserver-id"},
		{"no coordination, any id", func(o *rekeyOptions) { o.ClusterCoordination, o.APIServerID = false, "node/a" }, ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			o := newRekeyOptions()
			tc.change(o)
			errs := o.validate()
			switch {
			case tc.want == "" && len(errs) > 0:
				t.Fatalf("unexpected errors: %v", errs)
			case tc.want != "" && (len(errs) != 1 || !strings.Contains(errs[0].Error(), tc.want)):
				t.Fatalf("errors %v, want one containing %q", errs, tc.want)
			}
		})
	}
}
