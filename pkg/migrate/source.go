package migrate

import (
	"fmt"
	"strings"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Resource is one stored resource and the etcd key range that holds it
// (storagelayout owns where that is). KeyPrefix ends in '/', e.g. "/registry/secrets/";
// the authenticated data of every value is its full key.
type Resource = storagelayout.Location

// ResourceFor returns where kube-apiserver stores gr under etcdPrefix: its table of
// built-in resources (deployments.apps at /registry/deployments/), else the custom
// resource convention <prefix>/<group>/<resource>/ marked Guessed. An apiserver or a
// command that can see the stored CustomResourceDefinitions asks a storagelayout.Layout
// instead.
func ResourceFor(etcdPrefix string, gr schema.GroupResource) Resource {
	return storagelayout.Kube(etcdPrefix).Locate(gr)
}

// ParseResource parses "secrets", "widgets.example.com" or
// "deployments.apps=/registry/deployments/", locating a name without a path in layout.
func ParseResource(layout *storagelayout.Layout, s string) (Resource, error) {
	name, path, explicit := strings.Cut(strings.TrimSpace(s), "=")
	if name == "" || strings.Contains(name, "*") {
		return Resource{}, fmt.Errorf("resource %q: name a concrete resource such as secrets or widgets.example.com (a wildcard rule's resources are found in etcd, not named)", s)
	}
	gr := schema.ParseGroupResource(name)
	if !explicit {
		return layout.Locate(gr), nil
	}
	if !strings.HasPrefix(path, "/") {
		return Resource{}, fmt.Errorf("resource %q: the etcd key prefix must start with '/'", s)
	}
	if !strings.HasSuffix(path, "/") {
		path += "/"
	}
	return Resource{GroupResource: gr, KeyPrefix: path}, nil
}

// Source supplies the current transformers and the description of what they write.
// Both must come from the configuration in use: the migration reads and rewrites with
// TransformerFor and classifies stored values against Rule.
type Source interface {
	TransformerFor(gr schema.GroupResource) value.Transformer
	// Rule describes the rule that applies to gr (exact, <group>/*, *.*, else identity).
	Rule(gr schema.GroupResource) transformers.RuleInfo
	// KnownPrefixes lists every stored prefix the configuration knows (all rules), so a
	// key name used by another resource is still recognised.
	KnownPrefixes() []string
}

// FromSet serves one immutable transformers.Set.
func FromSet(s *transformers.Set) Source {
	return FromRules(setTransformers{s}, s.Rules)
}

type setTransformers struct{ s *transformers.Set }

func (t setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return t.s.TransformerFor(gr)
}

// FromRules adapts anything that serves value.ResourceTransformers and can list its
// rules — in the apiserver shim, the reload agent:
//
//	migrate.FromRules(agent, func() []transformers.RuleInfo { return agent.Status().Resources })
//
// rules is called on every Rule and KnownPrefixes call, so a reload is seen at once.
func FromRules(rt value.ResourceTransformers, rules func() []transformers.RuleInfo) Source {
	return &rulesSource{rt: rt, rules: rules}
}

type rulesSource struct {
	rt    value.ResourceTransformers
	rules func() []transformers.RuleInfo
}

func (s *rulesSource) TransformerFor(gr schema.GroupResource) value.Transformer {
	return s.rt.TransformerForResource(gr)
}

func (s *rulesSource) Rule(gr schema.GroupResource) transformers.RuleInfo {
	return lookupRule(s.rules(), gr)
}

func (s *rulesSource) KnownPrefixes() []string {
	seen := map[string]bool{}
	var out []string
	for _, r := range s.rules() {
		for _, p := range r.ReadPrefixes {
			if !seen[p] {
				seen[p] = true
				out = append(out, p)
			}
		}
	}
	return out
}

// lookupRule finds the rule for gr the way a Set does: exact, <group>/*, *.*, identity.
func lookupRule(rules []transformers.RuleInfo, gr schema.GroupResource) transformers.RuleInfo {
	byGR := make(map[schema.GroupResource]transformers.RuleInfo, len(rules))
	for _, r := range rules {
		byGR[schema.ParseGroupResource(r.Resource)] = r
	}
	if r, ok := transformers.Lookup(byGR, gr); ok {
		return r
	}
	return transformers.NoRule(gr.String())
}

// writeTarget is what a resource's new values are written with: the stored prefix and,
// for KMS v2, the key id hash of the plugin's current key ("" while unknown).
type writeTarget struct {
	Prefix    string `json:"prefix"`
	KeyIDHash string `json:"keyIDHash,omitempty"`
}

func targetOf(r transformers.RuleInfo) writeTarget {
	t := writeTarget{Prefix: r.WritePrefix}
	if r.KMS != nil {
		t.KeyIDHash = r.KMS.KeyIDHash
	}
	return t
}

func (t writeTarget) String() string {
	if t.Prefix == "" {
		return "identity (plaintext)"
	}
	if t.KeyIDHash != "" {
		return t.Prefix + " key id " + t.KeyIDHash
	}
	return t.Prefix
}
