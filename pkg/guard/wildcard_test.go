package guard

import (
	"context"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// inventoryOfRules takes an inventory the way the apiserver and the CLI do: the rules'
// resources resolved against what is stored.
func inventoryOfRules(t *testing.T, cli *clientv3.Client, cfg *config.Config, set *transformers.Set) *migrate.Inventory {
	t.Helper()
	ctx := context.Background()
	var rules []string
	for _, e := range transformers.Describe(cfg) {
		rules = append(rules, e.Resources...)
	}
	res, err := (&migrate.Resolver{Client: cli, Layout: storagelayout.Kube("/registry")}).Resolve(ctx, rules)
	if err != nil {
		t.Fatal(err)
	}
	inv, err := migrate.TakeInventory(ctx, migrate.InventoryOptions{Client: cli, Source: migrate.FromSet(set), Resources: res.Resources, Wildcards: res.Wildcards})
	if err != nil {
		t.Fatal(err)
	}
	return inv
}

// "Encrypt everything" can finish a rotation: an inventory that resolved *.* against
// the stored key space covers it, so the old key is refused while any resource —
// Deployments at kube's path, a custom resource — holds objects under it, and let go
// once none does. On an empty etcd it goes at once.
func TestWildcardRuleIsCoveredByAResolvedInventory(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	both := enctest.MustConfig(t, enctest.ConfigYAML(`"*.*"`, "aesgcm:g2,g1"))
	onlyNew := enctest.MustConfig(t, enctest.ConfigYAML(`"*.*"`, "aesgcm:g2"))
	setBoth := enctest.MustSet(t, both)

	if vs := CheckChange(inventoryOfRules(t, cli, both, setBoth), both, onlyNew); len(vs) != 0 {
		t.Fatalf("on an empty etcd, dropping g1 from *.* was refused: %v", vs)
	}
	if vs := CheckChange(nil, both, onlyNew); len(vs) == 0 {
		t.Fatal("with no inventory, dropping g1 from *.* was allowed")
	}

	old := enctest.MustSet(t, enctest.MustConfig(t, enctest.ConfigYAML(`"*.*"`, "aesgcm:g1")))
	deployments := schema.GroupResource{Group: "apps", Resource: "deployments"}
	widgets := schema.GroupResource{Group: "example.com", Resource: "widgets"}
	enctest.WriteObjects(t, cli, old, deployments, "/registry/deployments/", 7)
	enctest.WriteObjects(t, cli, old, widgets, "/registry/example.com/widgets/", 3)
	crds := schema.GroupResource{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions"}
	crdKey := "/registry/apiextensions.k8s.io/customresourcedefinitions/widgets.example.com"
	crd, err := old.TransformerFor(crds).TransformToStorage(ctx, enctest.PlaintextFor(crdKey, 0), value.DefaultContext(crdKey))
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(ctx, crdKey, string(crd)); err != nil {
		t.Fatal(err)
	}

	inv := inventoryOfRules(t, cli, both, setBoth)
	vs := CheckChange(inv, both, onlyNew)
	got := map[string]int64{}
	for _, v := range vs {
		got[v.Resource] = v.Objects
	}
	if got["deployments.apps"] != 7 || got["widgets.example.com"] != 3 || got["customresourcedefinitions.apiextensions.k8s.io"] != 1 {
		t.Fatalf("violations = %v, want 7 deployments.apps, 3 widgets.example.com and 1 definition under g1", vs)
	}

	res, err := (&migrate.Resolver{Client: cli, Layout: storagelayout.Kube("/registry")}).Resolve(ctx, []string{"*.*"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := migrate.Migrate(ctx, migrate.Options{Client: cli, Source: migrate.FromSet(setBoth), Resources: res.Resources}); err != nil {
		t.Fatal(err)
	}
	if vs := CheckChange(inventoryOfRules(t, cli, both, setBoth), both, onlyNew); len(vs) != 0 {
		t.Fatalf("after every object moved to g2, dropping g1 was refused: %v", vs)
	}
}

// A rule naming a built-in group's resource is counted where kube-apiserver stores it;
// a resource whose location is only guessed never proves its key unused.
func TestNamedResourcesAtTheirRealLocation(t *testing.T) {
	cli := startEtcd(t)
	old := enctest.MustSet(t, enctest.MustConfig(t, enctest.ConfigYAML("deployments.apps", "aesgcm:g1")))
	enctest.WriteObjects(t, cli, old, schema.GroupResource{Group: "apps", Resource: "deployments"}, "/registry/deployments/", 5)
	both := enctest.MustConfig(t, enctest.ConfigYAML("deployments.apps", "aesgcm:g2,g1"))
	vs := CheckChange(inventoryOfRules(t, cli, both, enctest.MustSet(t, both)), both, enctest.MustConfig(t, enctest.ConfigYAML("deployments.apps", "aesgcm:g2")))
	if len(vs) != 1 || vs[0].Objects != 5 {
		t.Fatalf("violations = %v, want the 5 deployments under g1", vs)
	}

	crBoth := enctest.MustConfig(t, enctest.ConfigYAML("widgets.example.com", "aesgcm:g2,g1"))
	crNew := enctest.MustConfig(t, enctest.ConfigYAML("widgets.example.com", "aesgcm:g2"))
	vs = CheckChange(inventoryOfRules(t, cli, crBoth, enctest.MustSet(t, crBoth)), crBoth, crNew)
	if len(vs) == 0 || !strings.Contains(vs[0].Reason, "nothing says this resource is stored there") || !strings.Contains(vs[0].Reason, "--resources widgets.example.com=/path/") {
		t.Fatalf("violations = %v, want a refusal saying the location is a guess", vs)
	}
}
