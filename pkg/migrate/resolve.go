package migrate

import (
	"context"
	"fmt"
	"sort"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Resolution is what a set of rules covers in etcd: the concrete resources to scan.
type Resolution struct {
	Resources []Resource
	// Wildcards are the wildcard rules ("*.*", "*.apps") resolved by a scan of the whole
	// key space: every resource they match that held an object at Revision is in
	// Resources. An inventory of all of Resources therefore covers them.
	Wildcards []string
	Revision  int64
}

// Resolver turns a configuration's rules into the concrete resources stored in etcd.
type Resolver struct {
	Client *clientv3.Client
	Layout *storagelayout.Layout
	// Skip are key prefixes under the etcd prefix that hold no resource (the
	// coordination prefix when it lies there).
	Skip []string
	// Extra are resources scanned whatever the rules say (named by the operator).
	Extra []Resource
}

// Resolve returns the resources rules (resource names as a configuration writes them,
// wildcards included) cover: every named resource where the layout stores it, and for
// a wildcard every stored resource it matches that no more specific rule names. The
// stored CustomResourceDefinitions are read first so custom resources are located.
// Without a wildcard and with a Layout that knows every named resource, it reads
// nothing but the definitions' keys.
func (r *Resolver) Resolve(ctx context.Context, rules []string) (Resolution, error) {
	var res Resolution
	seen := map[string]bool{}
	add := func(loc Resource) {
		if !seen[loc.KeyPrefix] {
			seen[loc.KeyPrefix] = true
			res.Resources = append(res.Resources, loc)
		}
	}
	if r.Client != nil {
		if err := r.Layout.AddStoredCRDs(ctx, r.Client); err != nil {
			return res, err
		}
	}
	exact := map[schema.GroupResource]bool{}
	var wildcards []schema.GroupResource
	for _, name := range rules {
		gr := schema.ParseGroupResource(name)
		if gr.Resource == "*" {
			wildcards = append(wildcards, gr)
			continue
		}
		exact[gr] = true
		add(r.Layout.Locate(gr))
	}
	for _, e := range r.Extra {
		if e.Guessed {
			// Named before the stored definitions were read: a custom resource is
			// known now if its definition is stored.
			e = r.Layout.Locate(e.GroupResource)
		}
		add(e)
	}
	if len(wildcards) == 0 {
		return res, nil
	}
	if r.Client == nil {
		return res, fmt.Errorf("resolving %s needs etcd: the resources a wildcard rule covers are found there", wildcardNames(wildcards))
	}
	stored, rev, err := r.Layout.Stored(ctx, r.Client, r.Skip...)
	if err != nil {
		return res, err
	}
	res.Revision = rev
	for _, loc := range stored {
		if exact[loc.GroupResource] {
			continue
		}
		for _, w := range wildcards {
			if transformers.RuleCovers(w, loc.GroupResource) {
				add(loc)
				break
			}
		}
	}
	res.Wildcards = wildcardNames(wildcards)
	return res, nil
}

func wildcardNames(ws []schema.GroupResource) []string {
	out := make([]string, 0, len(ws))
	for _, w := range ws {
		out = append(out, config.GroupResourceString(w))
	}
	sort.Strings(out)
	return out
}
