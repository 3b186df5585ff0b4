// Package enctest holds the fixtures of tests that store encrypted objects and read
// them back (pkg/migrate, pkg/guard): encryption configurations written from short
// provider specs, Sets built from them, objects written as an apiserver writes them,
// and an in-process KMS v2 plugin. It imports neither package, so each can use it from
// its own internal tests.
//
//	cfg := enctest.MustConfig(t, enctest.ConfigYAML("secrets", "aesgcm:key2,key1", "identity"))
//	set := enctest.MustSet(t, cfg)
//	keys := enctest.WriteObjects(t, cli, set, gr, "/registry/secrets/", 100)
package enctest

import (
	"bytes"
	"context"
	"crypto/cipher"
	"crypto/fips140"
	"encoding/base64"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	aestransformer "k8s.io/apiserver/pkg/storage/value/encrypt/aes"
	"k8s.io/apiserver/pkg/storage/value/encrypt/envelope"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// TestKey derives a deterministic key of n bytes for name (test material only).
func TestKey(name string, n int) string {
	k := make([]byte, n)
	for i := range k {
		k[i] = byte(len(name)*13+i*7) ^ name[i%len(name)]
	}
	return base64.StdEncoding.EncodeToString(k)
}

// ProviderYAML writes one provider of a rule from a spec: "aesgcm:k1,k2",
// "aescbc:k1", "secretbox:k1", "identity". "k1=other" names key k1 but derives its
// secret from "other": the same name with another secret.
func ProviderYAML(spec string) string {
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
		fmt.Fprintf(&b, "            - {name: %q, secret: %s}\n", name, TestKey(kind+secretName, size))
	}
	return b.String()
}

// ConfigYAML builds a configuration with one rule for resources (as written in a
// rule: "secrets", "configmaps, '*.apps'") and the providers of specs (ProviderYAML).
func ConfigYAML(resources string, providers ...string) string {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [" + resources + "]\n    providers:\n")
	for _, p := range providers {
		b.WriteString(ProviderYAML(p))
	}
	return b.String()
}

// MustConfig parses yaml as a reloadable configuration named test.yaml.
func MustConfig(t testing.TB, yaml string) *config.Config {
	t.Helper()
	cfg, err := config.Parse([]byte(yaml), "test.yaml", config.Options{Reload: true})
	if err != nil {
		t.Fatal(err)
	}
	return cfg
}

// MustSet builds cfg (no KMS) and closes the Set when the test ends.
func MustSet(t testing.TB, cfg *config.Config) *transformers.Set {
	t.Helper()
	s, err := transformers.Build(context.Background(), cfg, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// PlaintextFor is a stand-in for the protobuf an apiserver stores: the k8s\x00
// envelope around a runtime.Unknown naming a v1 Secret.
func PlaintextFor(key string, gen int) []byte {
	return StoredObject(fmt.Sprintf("{key=%s gen=%d pad=%s}", key, gen, strings.Repeat("x", 200)))
}

// StoredObject wraps raw in the protobuf envelope kube-apiserver stores objects in.
func StoredObject(raw string) []byte {
	u := runtime.Unknown{TypeMeta: runtime.TypeMeta{APIVersion: "v1", Kind: "Secret"}, Raw: []byte(raw)}
	b, err := u.Marshal()
	if err != nil {
		panic(err)
	}
	return append([]byte("k8s\x00"), b...)
}

// WriteObjects stores n objects of gr under keyPrefix (the resource's etcd key prefix,
// ending in '/'), encrypted with set as an apiserver would (authenticated data = the
// etcd key), in transactions of 100 puts. It returns their keys.
func WriteObjects(t testing.TB, cli *clientv3.Client, set *transformers.Set, gr schema.GroupResource, keyPrefix string, n int) []string {
	t.Helper()
	return WriteObjectsWith(t, cli, set.TransformerFor(gr), keyPrefix, n)
}

// WriteObjectsWith is WriteObjects through any transformer: upstream's (UpstreamKMSv1)
// to store what a kube-apiserver wrote.
func WriteObjectsWith(t testing.TB, cli *clientv3.Client, tr value.Transformer, keyPrefix string, n int) []string {
	t.Helper()
	ctx := context.Background()
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
		key := fmt.Sprintf("%sns%d/obj-%06d", keyPrefix, i%10, i)
		out, err := tr.TransformToStorage(ctx, PlaintextFor(key, 0), value.DefaultContext(key))
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

// KMS is an in-process KMS v2 plugin (internal/kmsplugin) and a factory whose
// providers poll its Status quickly, so a key id change is seen within a second.
type KMS struct {
	KeysFile string
	Socket   string
	Server   *kmsplugin.Server
	Factory  transformers.KMSFactory
	// apiVersion is the KMS API the plugin serves: "" (v2) or kmsplugin.APIVersionV1.
	apiVersion string
}

// StartKMS starts a plugin holding keyIDs (the first is the active one) and stops it
// when the test ends.
func StartKMS(t testing.TB, keyIDs ...string) *KMS {
	t.Helper()
	dir := t.TempDir()
	e := &KMS{KeysFile: filepath.Join(dir, "keys.yaml")}
	e.SetKeys(t, keyIDs...)
	e.start(t, filepath.Join(dir, "kms.sock"))
	e.Factory = kmsv2.NewFactory(kmsv2.FactoryOptions{StatusInterval: 100 * time.Millisecond, RetryInterval: 100 * time.Millisecond})
	return e
}

// StartPlugin starts another plugin on its own socket serving keysFile (another
// keyring, or the same one at a new endpoint). Its Factory is nil: build with the
// factory of a StartKMS plugin.
func StartPlugin(t testing.TB, keysFile string) *KMS {
	t.Helper()
	e := &KMS{KeysFile: keysFile}
	e.start(t, filepath.Join(t.TempDir(), "kms.sock"))
	return e
}

func (e *KMS) start(t testing.TB, socket string) {
	t.Helper()
	e.Socket = socket
	srv, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: "unix://" + e.Socket, KeysFile: e.KeysFile, APIVersion: e.apiVersion})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(srv.Stop)
	e.Server = srv
}

// Restart starts the plugin again on its socket after Server.Stop (a plugin that
// crashed and came back), with the same keys and API version.
func (e *KMS) Restart(t testing.TB) {
	t.Helper()
	e.start(t, e.Socket)
}

// SetKeys writes the plugin's keys file; the first key id is the active one. The
// plugin picks the change up as an operator's edit.
func (e *KMS) SetKeys(t testing.TB, keyIDs ...string) {
	t.Helper()
	var b strings.Builder
	b.WriteString("keys:\n")
	for _, id := range keyIDs {
		k := bytes.Repeat([]byte{byte(len(id)) + id[len(id)-1]}, 32)
		fmt.Fprintf(&b, "  - {name: %s, secret: %s}\n", id, base64.StdEncoding.EncodeToString(k))
	}
	tmp := e.KeysFile + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(tmp, e.KeysFile); err != nil {
		t.Fatal(err)
	}
}

// ProviderYAML is a KMS provider named name that reaches this plugin: apiVersion v2,
// or v1 for a StartKMSv1 plugin.
func (e *KMS) ProviderYAML(name string) string {
	if e.apiVersion == kmsplugin.APIVersionV1 {
		return fmt.Sprintf("      - kms: {apiVersion: v1, name: %s, endpoint: %q, timeout: 3s}\n", name, e.Endpoint())
	}
	return fmt.Sprintf("      - kms: {apiVersion: v2, name: %s, endpoint: %q, timeout: 3s}\n", name, e.Endpoint())
}

// Endpoint is the plugin's unix:// endpoint.
func (e *KMS) Endpoint() string { return "unix://" + e.Socket }

// StartKMSv1 starts a KMS v1 plugin (k8s.io/kms/apis/v1beta1) holding keyIDs (the
// first wraps new DEKs) and stops it when the test ends. rekey only reads through it:
// write KMS v1 values with UpstreamKMSv1.
func StartKMSv1(t testing.TB, keyIDs ...string) *KMS {
	t.Helper()
	dir := t.TempDir()
	e := &KMS{KeysFile: filepath.Join(dir, "keys.yaml"), apiVersion: kmsplugin.APIVersionV1}
	e.SetKeys(t, keyIDs...)
	e.start(t, filepath.Join(dir, "kmsv1.sock"))
	return e
}

// UpstreamKMSv1 is kube-apiserver's own KMS v1 transformer for provider name at
// endpoint (k8s.io/apiserver's gRPC v1 client and envelope transformer behind the
// k8s:enc:kms:v1:<name>: prefix): what a cluster with a KMS v1 provider first wrote.
// cbc selects the data cipher of Kubernetes 1.24 and earlier (AES-CBC) instead of
// AES-GCM (1.25 and later); both read either, as upstream does.
//
// Under GODEBUG=fips140=only it skips the test: upstream's KMS v1 envelope seals with
// cipher.NewGCM, which Go refuses there, so no KMS v1 value can be written, and KMS v1
// is outside FIPS mode's approved set (transformers.FIPSApproved) anyway.
func UpstreamKMSv1(t testing.TB, endpoint, name string, cbc bool) value.Transformer {
	t.Helper()
	SkipUnderFIPSOnly(t, "KMS v1 values cannot be written (upstream's KMS v1 envelope seals with cipher.NewGCM) and KMS v1 is outside the approved set")
	svc, err := envelope.NewGRPCService(t.Context(), endpoint, 3*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	base := func(block cipher.Block) (value.Transformer, error) {
		gcm, err := aestransformer.NewGCMTransformer(block)
		if err != nil {
			return nil, err
		}
		if cbc {
			return aestransformer.NewCBCTransformer(block), nil
		}
		return gcm, nil
	}
	return value.NewPrefixTransformers(errors.New("no matching prefix found"), value.PrefixTransformer{
		Prefix:      []byte(transformers.KeyPrefix(transformers.KMSv1Prefix, name)),
		Transformer: envelope.NewEnvelopeTransformer(svc, 1000, base),
	})
}

// SkipUnderFIPSOnly skips t under GODEBUG=fips140=only (crypto/fips140.Enforced), saying
// why: only for a test whose subject that mode makes impossible (docs/fips.md lists them).
func SkipUnderFIPSOnly(t testing.TB, why string) {
	t.Helper()
	if fips140.Enforced() {
		t.Skip("impossible under GODEBUG=fips140=only: " + why)
	}
}

// BuildReady builds a Set and waits until its KMS providers can write.
func BuildReady(t testing.TB, yaml string, kms transformers.KMSFactory) *transformers.Set {
	t.Helper()
	cfg := MustConfig(t, yaml)
	set, err := transformers.Build(context.Background(), cfg, transformers.Options{KMS: kms})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	for _, k := range set.KMSProviders() {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		err := k.WaitReady(ctx)
		cancel()
		if err != nil {
			t.Fatalf("kms provider %s not ready: %v", k.Name(), err)
		}
	}
	return set
}
