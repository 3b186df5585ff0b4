package main

import (
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	genericoptions "k8s.io/apiserver/pkg/server/options"
	"k8s.io/apiserver/pkg/storage/storagebackend"
	"k8s.io/kubernetes/pkg/controlplane"
	"k8s.io/kubernetes/pkg/kubeapiserver"
	"k8s.io/kubernetes/test/integration/etcd"

	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// storedByKube reports whether kube-apiserver's own storage factory stores gr: the
// apiextensions and aggregator servers keep their resources at <group>/<resource>, and
// upstream's table also lists custom resources its tests create.
func storedByKube(gr schema.GroupResource, dir string) bool {
	return !strings.HasPrefix(dir, gr.Group+"/")
}

// storagelayout's table of built-in resources is checked against what kube-apiserver
// v1.37.2 really does: upstream's own table of expected etcd paths (the one its etcd
// storage path test enforces) and the prefixes its storage factory computes. A
// Kubernetes upgrade that adds or moves a resource fails here first.
func TestLayoutTableMatchesKubeAPIServer(t *testing.T) {
	const ns = "layout-ns"
	opts := genericoptions.NewEtcdOptions(storagebackend.NewDefaultConfig("/registry", nil))
	fc := kubeapiserver.NewStorageFactoryConfig()
	fc.APIResourceConfig = controlplane.DefaultAPIResourceConfigSource()
	factory, err := fc.Complete(opts).New()
	if err != nil {
		t.Fatal(err)
	}
	table := map[schema.GroupResource]string{}
	for _, b := range storagelayout.KubeBuiltins() {
		table[b.GroupResource] = b.Dir
	}
	layout := storagelayout.Kube("/registry")
	checked := map[schema.GroupResource]bool{}
	for gvr, data := range etcd.GetEtcdStorageDataForNamespace(ns) {
		gr := gvr.GroupResource()
		rel := strings.TrimPrefix(data.ExpectedEtcdPath, "/registry/")
		if i := strings.Index(rel, "/"+ns+"/"); i >= 0 {
			rel = rel[:i]
		} else {
			rel = rel[:strings.LastIndex(rel, "/")]
		}
		loc := layout.Locate(gr)
		if want := "/registry/" + rel + "/"; loc.Guessed && storedByKube(gr, rel) || (!loc.Guessed && loc.KeyPrefix != want) {
			t.Errorf("%s: the layout says %s (guessed %v); kube-apiserver stores it at %s", gr, loc.KeyPrefix, loc.Guessed, want)
		}
		if storedByKube(gr, rel) {
			if got := factory.ResourcePrefix(gr); got != rel {
				t.Errorf("%s: the storage factory's resource prefix is %q, upstream's table says %q", gr, got, rel)
			}
			if table[gr] != rel {
				t.Errorf("%s: KubeBuiltins has %q, kube-apiserver stores it at %q", gr, table[gr], rel)
			}
		}
		checked[gr] = true
	}
	// Every row of the table is checked, by upstream's data or (the cohabiting
	// resources of retired groups, which upstream no longer serves) by the factory.
	for gr, dir := range table {
		if checked[gr] || strings.HasPrefix(dir, gr.Group+"/") {
			continue
		}
		if got := factory.ResourcePrefix(gr); got != dir {
			t.Errorf("%s: KubeBuiltins has %q, the storage factory says %q", gr, dir, got)
		}
	}
	if len(checked) < 60 {
		t.Fatalf("only %d resources in upstream's table: the check did not run against it", len(checked))
	}
}
