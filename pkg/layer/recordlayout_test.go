package layer

import (
	"testing"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/registry/generic"
	"k8s.io/apiserver/pkg/storage/storagebackend"

	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// prefixGetter answers as a storage factory does: its etcd prefix and a resource prefix.
type prefixGetter map[schema.GroupResource]string

func (p prefixGetter) GetRESTOptions(gr schema.GroupResource, _ runtime.Object) (generic.RESTOptions, error) {
	cfg := storagebackend.Config{Prefix: "/registry"}
	return generic.RESTOptions{StorageConfig: cfg.ForResource(gr), ResourcePrefix: p[gr]}, nil
}

// What the getter reports is where the layout locates the resource from then on, even
// where kube's table or the convention would say otherwise.
func TestWithLayoutRecording(t *testing.T) {
	widgets := schema.GroupResource{Group: "example.com", Resource: "widgets"}
	flows := schema.GroupResource{Group: "flowcontrol.apiserver.k8s.io", Resource: "flowschemas"}
	layout := storagelayout.Kube("/registry")
	g := WithLayoutRecording(prefixGetter{widgets: "/example.com/widgets", flows: "/custom-flows"}, layout)
	if loc := layout.Locate(widgets); !loc.Guessed {
		t.Fatalf("before serving: %+v", loc)
	}
	for _, gr := range []schema.GroupResource{widgets, flows} {
		if _, err := g.GetRESTOptions(gr, nil); err != nil {
			t.Fatal(err)
		}
	}
	if loc := layout.Locate(widgets); loc.Guessed || loc.KeyPrefix != "/registry/example.com/widgets/" {
		t.Errorf("widgets: %+v", loc)
	}
	if loc := layout.Locate(flows); loc.KeyPrefix != "/registry/custom-flows/" {
		t.Errorf("flowschemas: %+v, want the getter's prefix", loc)
	}
}
