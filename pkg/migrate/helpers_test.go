package migrate

import (
	"bytes"
	"context"
	"encoding/base64"
	"fmt"
	"strings"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

var (
	secrets    = schema.GroupResource{Resource: "secrets"}
	configmaps = schema.GroupResource{Resource: "configmaps"}
)

// testKey derives a deterministic key of n bytes for name (test material only).
func testKey(name string, n int) string {
	k := make([]byte, n)
	for i := range k {
		k[i] = byte(len(name)*13+i*7) ^ name[i%len(name)]
	}
	return base64.StdEncoding.EncodeToString(k)
}

// provider snippets: "aesgcm:k1,k2", "aescbc:k1", "secretbox:k1", "identity".
func providerYAML(spec string) string {
	kind, keys, _ := strings.Cut(spec, ":")
	if kind == "identity" {
		return "      - identity: {}\n"
	}
	size := 32
	var b strings.Builder
	fmt.Fprintf(&b, "      - %s:\n          keys:\n", kind)
	for _, k := range strings.Split(keys, ",") {
		name, secretName, ok := strings.Cut(k, "=")
		if !ok {
			secretName = name
		}
		fmt.Fprintf(&b, "            - {name: %q, secret: %s}\n", name, testKey(kind+secretName, size))
	}
	return b.String()
}

// configYAML builds a configuration with one rule for resources.
func configYAML(resources string, providers ...string) string {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [" + resources + "]\n    providers:\n")
	for _, p := range providers {
		b.WriteString(providerYAML(p))
	}
	return b.String()
}

func mustConfig(t testing.TB, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml), "test.yaml", config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

func mustSet(t testing.TB, cfg *config.Config) *transformers.Set {
	t.Helper()
	s, err := transformers.Build(context.Background(), cfg, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
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

// plaintextFor is a stand-in for the protobuf an apiserver stores: the k8s\x00
// envelope around a runtime.Unknown naming a v1 Secret.
func plaintextFor(key string, gen int) []byte {
	return storedObject(fmt.Sprintf("{key=%s gen=%d pad=%s}", key, gen, strings.Repeat("x", 200)))
}

// storedObject wraps raw in the protobuf envelope kube-apiserver stores objects in.
func storedObject(raw string) []byte {
	u := runtime.Unknown{TypeMeta: runtime.TypeMeta{APIVersion: "v1", Kind: "Secret"}, Raw: []byte(raw)}
	b, err := u.Marshal()
	if err != nil {
		panic(err)
	}
	return append([]byte("k8s\x00"), b...)
}

// writeObjects stores n objects of gr encrypted with set, as an apiserver would
// (authenticated data = the etcd key), in transactions of 100 puts.
func writeObjects(t testing.TB, cli *clientv3.Client, set *transformers.Set, gr schema.GroupResource, n int) []string {
	t.Helper()
	ctx := context.Background()
	tr := set.TransformerFor(gr)
	var keys []string
	var ops []clientv3.Op
	flush := func() {
		if len(ops) == 0 {
			return
		}
		if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
			t.Fatal(err)
		}
		ops = ops[:0]
	}
	for i := 0; i < n; i++ {
		key := keyOf(gr, fmt.Sprintf("ns%d", i%10), fmt.Sprintf("obj-%06d", i))
		out, err := tr.TransformToStorage(ctx, plaintextFor(key, 0), value.DefaultContext(key))
		if err != nil {
			t.Fatal(err)
		}
		ops = append(ops, clientv3.OpPut(key, string(out)))
		keys = append(keys, key)
		if len(ops) == 100 {
			flush()
		}
	}
	flush()
	return keys
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
