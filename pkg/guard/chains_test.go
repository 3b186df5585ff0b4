package guard

import (
	"context"
	"slices"
	"strings"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestGuardSeesWhatTheSetBuilds: the guard judges a configuration without building it.
// Over every configuration of the compatibility matrix, for exact, group-wildcard,
// `*.*` and unmatched resources (and the wildcard pseudo-resources the guard judges),
// its chain must have the write prefix and the read prefixes, in order, of the chain a
// Set built from the same configuration serves, and its rules the Set's rules in file
// order. If they ever differ, the guard lets through (or refuses) a change by a
// different rule than the one that reads the data.
func TestGuardSeesWhatTheSetBuilds(t *testing.T) {
	configs := map[string]string{"lookup": compatconfigs.Lookup}
	for _, o := range compatconfigs.Orders {
		configs[strings.Join(o, ",")] = compatconfigs.ConfigFor("secrets", o...)
		configs["group:"+strings.Join(o, ",")] = compatconfigs.ConfigFor("configmaps, '*.apps'", o...)
		configs["any:"+strings.Join(o, ",")] = compatconfigs.ConfigFor("'*.*'", o...)
	}
	resources := []schema.GroupResource{
		{Resource: "secrets"}, {Resource: "configmaps"}, {Resource: "pods"},
		{Group: "apps", Resource: "deployments"}, {Group: "batch", Resource: "jobs"},
		{Group: "apps", Resource: "*"}, {Group: "*", Resource: "*"},
	}
	ctx := context.Background()
	for name, yaml := range configs {
		cfg, err := config.Parse([]byte(yaml), name, config.Options{})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		set, err := transformers.Build(ctx, cfg, transformers.Options{})
		if err != nil {
			t.Fatalf("%s: %v", name, err)
		}
		guard := newChains(cfg)
		for _, gr := range resources {
			info := set.TransformerFor(gr).Info()
			c := guard.lookup(gr)
			var read []string
			for _, e := range c.entries {
				read = append(read, e.prefix)
			}
			if wp, _ := c.writePrefix(); wp != info.WritePrefix || !slices.Equal(read, info.ReadPrefixes) {
				t.Errorf("%s, %s: the guard sees write %q read %q; the Set writes %q and reads %q", name, gr, wp, read, info.WritePrefix, info.ReadPrefixes)
			}
		}
		var setOrder, guardOrder []string
		for _, r := range set.Rules() {
			setOrder = append(setOrder, r.Resource)
		}
		for _, gr := range guard.order {
			guardOrder = append(guardOrder, config.GroupResourceString(gr))
		}
		if !slices.Equal(setOrder, guardOrder) {
			t.Errorf("%s: the guard judges rules %q, the Set has %q", name, guardOrder, setOrder)
		}
		set.Close()
	}
}
