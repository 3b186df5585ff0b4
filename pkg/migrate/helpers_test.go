package migrate

import (
	"bytes"
	"context"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var (
	secrets    = schema.GroupResource{Resource: "secrets"}
	configmaps = schema.GroupResource{Resource: "configmaps"}
)

// The fixtures shared with pkg/guard's tests live in internal/enctest; these keep the
// short names this package's tests use.

func providerYAML(spec string) string { return enctest.ProviderYAML(spec) }

func configYAML(resources string, providers ...string) string {
	return enctest.ConfigYAML(resources, providers...)
}

func mustConfig(t testing.TB, yaml string) *config.Config {
	t.Helper()
	return enctest.MustConfig(t, yaml)
}

func mustSet(t testing.TB, cfg *config.Config) *transformers.Set {
	t.Helper()
	return enctest.MustSet(t, cfg)
}

func setFor(t testing.TB, resources string, providers ...string) (*config.Config, *transformers.Set) {
	cfg := mustConfig(t, configYAML(resources, providers...))
	return cfg, mustSet(t, cfg)
}

func testResources() []Resource {
	return []Resource{ResourceFor(DefaultEtcdPrefix, secrets), ResourceFor(DefaultEtcdPrefix, configmaps)}
}

func keyOf(gr schema.GroupResource, ns, name string) string {
	return ResourceFor(DefaultEtcdPrefix, gr).KeyPrefix + ns + "/" + name
}

func plaintextFor(key string, gen int) []byte { return enctest.PlaintextFor(key, gen) }

func storedObject(raw string) []byte { return enctest.StoredObject(raw) }

func writeObjects(t testing.TB, cli *clientv3.Client, set *transformers.Set, gr schema.GroupResource, n int) []string {
	t.Helper()
	return enctest.WriteObjects(t, cli, set, gr, ResourceFor(DefaultEtcdPrefix, gr).KeyPrefix, n)
}

// readPlain reads key and decrypts it with set; it fails the test if it cannot.
func readPlain(t testing.TB, cli *clientv3.Client, set *transformers.Set, gr schema.GroupResource, key string) (plain []byte, stale bool, modRev int64) {
	t.Helper()
	resp, err := cli.Get(context.Background(), key)
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Kvs) == 0 {
		t.Fatalf("%s: not found", key)
	}
	kv := resp.Kvs[0]
	p, s, err := set.TransformerFor(gr).TransformFromStorage(context.Background(), kv.Value, value.DefaultContext(kv.Key))
	if err != nil {
		t.Fatalf("%s: unreadable: %v", key, err)
	}
	return p, s, kv.ModRevision
}

func startEtcd(t testing.TB) *clientv3.Client {
	t.Helper()
	return etcdtest.Start(t).Client(t)
}

// bucketCount returns the objects of ri with the given prefix and staleness.
func bucketCount(ri *ResourceInventory, prefix string, stale bool) int64 {
	var n int64
	for _, b := range ri.Buckets {
		if b.Prefix == prefix && b.Stale == stale {
			n += b.Objects
		}
	}
	return n
}

func hasPrefix(v []byte, p string) bool { return bytes.HasPrefix(v, []byte(p)) }
