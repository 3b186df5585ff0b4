package cluster

import (
	"context"
	"fmt"
	"reflect"
	"strings"
	"testing"
	"time"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// TestEveryConsumerSeesTheSameChain: for every compatibility configuration and every
// resource — named ones, and those that only a `*.<group>` or `*.*` rule (or none)
// serves — the chain a built Set serves (RuleInfo/KeyInfo), the chain
// Describe+ByResource+Lookup give, the rule of the member record this apiserver
// publishes, and the rule the cluster guard reads from the configuration are the same
// entries in the same order; and DescribeRules lists exactly the rules Set.Rules does.
func TestEveryConsumerSeesTheSameChain(t *testing.T) {
	configs := compatconfigs.Matrix()
	configs["apps-and-all"] = compatconfigs.ConfigFor("'*.apps', configmaps", "aesgcm", "identity") +
		"  - resources: ['*.*']\n    providers:\n" + compatconfigs.ProviderYAML["secretbox"]
	configs["core-wildcard"] = compatconfigs.ConfigFor("'*.'", "aescbc-rev", "identity")
	vault := "      - kms: {apiVersion: v2, name: vault, endpoint: 'unix:///tmp/vault.sock'}\n"
	configs["kms"] = compatconfigs.ConfigFor("secrets, '*.apps'", "identity") +
		"  - resources: [secrets]\n    providers:\n" + vault + compatconfigs.ProviderYAML["aesgcm"] +
		"  - resources: ['*.*']\n    providers:\n" + strings.ReplaceAll(vault, "vault", "hsm")
	// KMS v1 is read behind a writer, never written.
	configs["kmsv1"] = compatconfigs.ConfigFor("secrets, '*.apps'", "aesgcm") + "      - kms: {name: old, endpoint: 'unix:///tmp/old.sock'}\n" +
		"  - resources: ['*.*']\n    providers:\n" + compatconfigs.ProviderYAML["secretbox"] + "      - kms: {name: older, endpoint: 'unix:///tmp/older.sock'}\n"
	queries := []string{"secrets", "configmaps", "pods", "deployments.apps", "*.apps", "jobs.batch", "*.batch", "*.", "*.*"}

	ctx := context.Background()
	for name, yaml := range configs {
		t.Run(name, func(t *testing.T) {
			cfg, err := config.Parse([]byte(yaml), name+".yaml", config.Options{})
			if err != nil {
				t.Fatalf("parse: %v\n%s", err, yaml)
			}
			set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: stubKMS})
			if err != nil {
				t.Fatal(err)
			}
			defer set.Close()

			// The rules themselves: DescribeRules is Set.Rules without what only a
			// running Set knows (KMS key ids and status).
			built := set.Rules()
			for i := range built {
				built[i].KMS = nil
				for j := range built[i].ReadKeys {
					built[i].ReadKeys[j].KeyIDHash = ""
				}
			}
			if described := transformers.DescribeRules(cfg); !reflect.DeepEqual(described, built) {
				t.Errorf("DescribeRules:\n%+v\nSet.Rules:\n%+v", described, built)
			}

			byGR, _ := transformers.ByResource(transformers.Describe(cfg))
			published := stateFromStatus("self", "", reload.Status{Resources: set.Rules()}, nil, time.Time{})
			guard := configState("self", cfg)
			var named []string
			for _, r := range set.Rules() {
				named = append(named, r.Resource)
			}
			for _, q := range append(named, queries...) {
				gr := schema.ParseGroupResource(q)
				want := entries(set.TransformerFor(gr).Info().ReadKeys)
				var described []Key
				if keys, ok := transformers.Lookup(byGR, gr); ok {
					for _, k := range keys {
						described = append(described, Key{Provider: k.Provider, Key: k.Name})
					}
				} else {
					described = []Key{{Provider: transformers.ProviderIdentity}}
				}
				memberRule, _ := published.Rule(q)
				guardRule, _ := guard.Rule(q)
				for consumer, got := range map[string][]Key{
					"Describe+ByResource+Lookup": described,
					"member record":              memberRule.Read,
					"cluster guard":              guardRule.Read,
				} {
					if entries(got) != want {
						t.Errorf("%s: %s sees %s, the Set serves %s", q, consumer, entries(got), want)
					}
				}
				writer, _, _ := strings.Cut(want, ",")
				for consumer, got := range map[string]Key{"member record": memberRule.Write, "cluster guard": guardRule.Write} {
					if entries([]Key{got}) != writer {
						t.Errorf("%s: %s writes with %s, the Set with %s", q, consumer, entries([]Key{got}), writer)
					}
				}
			}
		})
	}
}

// entries names a chain's entries in order, without KMS key ids.
func entries(keys []Key) string {
	var names []string
	for _, k := range keys {
		k.KeyIDHash = ""
		names = append(names, k.String())
	}
	return strings.Join(names, ",")
}

// stubKMS builds a KMS v2 provider that only has a name and a prefix: enough for a Set
// to describe its rules.
func stubKMS(_ context.Context, cfg *apiserver.KMSConfiguration, _ transformers.Options) (transformers.KMSProvider, error) {
	return stubProvider{name: cfg.Name}, nil
}

type stubProvider struct{ name string }

func (p stubProvider) Prefix() []byte {
	return []byte(transformers.KeyPrefix(transformers.KMSv2Prefix, p.name))
}
func (p stubProvider) Seal(context.Context, []byte, value.Context) ([]byte, error) {
	return nil, fmt.Errorf("stub KMS provider %s does not encrypt", p.name)
}
func (p stubProvider) Open(context.Context, []byte, value.Context) ([]byte, bool, error) {
	return nil, false, fmt.Errorf("stub KMS provider %s does not decrypt", p.name)
}
func (p stubProvider) Name() string                    { return p.name }
func (p stubProvider) Check(context.Context) error     { return nil }
func (p stubProvider) WaitReady(context.Context) error { return nil }
func (p stubProvider) Status() transformers.KMSStatus {
	return transformers.KMSStatus{Name: p.name, Healthy: true, KeyIDHash: "sha256:stub"}
}
func (p stubProvider) Close() {}
