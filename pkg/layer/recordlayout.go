package layer

import (
	"path"

	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/registry/generic"

	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// WithLayoutRecording returns a RESTOptionsGetter that records in layout where every
// resource it builds storage for is stored: the storage factory's own answer
// (its etcd prefix and resource prefix), so the inventory, the migration and the guard
// look where this apiserver really writes. A binary wraps each getter it serves from —
// kube-apiserver's, and its apiextensions (custom resources, as each definition is
// served) and aggregator servers'.
func WithLayoutRecording(g generic.RESTOptionsGetter, layout *storagelayout.Layout) generic.RESTOptionsGetter {
	if g == nil || layout == nil {
		return g
	}
	return layoutGetter{RESTOptionsGetter: g, layout: layout}
}

type layoutGetter struct {
	generic.RESTOptionsGetter
	layout *storagelayout.Layout
}

func (g layoutGetter) GetRESTOptions(gr schema.GroupResource, example runtime.Object) (generic.RESTOptions, error) {
	o, err := g.RESTOptionsGetter.GetRESTOptions(gr, example)
	if err != nil || o.StorageConfig == nil || o.ResourcePrefix == "" {
		return o, err
	}
	// A resource stored under another --etcd-prefix (an --etcd-servers-overrides
	// entry keeps the prefix) is outside this layout: left as the table says.
	_ = g.layout.AddKeyPrefix(gr, path.Join("/", o.StorageConfig.Prefix, o.ResourcePrefix)+"/")
	return o, nil
}
