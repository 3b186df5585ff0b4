// Package testbed starts and inspects the pieces rekey is proven on — etcd, the KMS v2
// plugin and the apiserver shim — as real processes on free ports, and offers the
// checks tests need against them: raw etcd reads and upstream k8s.io/apiserver
// transformers to decrypt or write stored values independently of rekey.
//
// For many apiservers on one cluster it also has: an etcd cluster of processes whose
// members stop, die and rejoin (EtcdCluster); a Fleet of shims, each with its own copy
// of the encryption config; a FileSyncer that applies a change to each copy after its
// own seeded random delay, as kubelets refresh a mounted Secret; a Workload with
// Writers and a Sampler that record every acknowledged write and count unreadable,
// missing and stale reads; and end checks (StoredPrefixes, Verify, WaitFor with
// probes on etcd, member keys and status documents).
package testbed

import (
	"context"
	"crypto/fips140"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	"go.uber.org/zap"
	corev1 "k8s.io/api/core/v1"
	"k8s.io/apimachinery/pkg/runtime"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apimachinery/pkg/runtime/serializer"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// RandomKey returns a base64 AES-256 key for an EncryptionConfiguration.
func RandomKey() string {
	k := make([]byte, 32)
	if _, err := rand.Read(k); err != nil {
		panic(err) // crypto/rand never fails on Linux
	}
	return base64.StdEncoding.EncodeToString(k)
}

// WriteFileAtomic replaces path with data through a rename, as editors and config
// management do, so a watcher never sees a half-written file.
func WriteFileAtomic(path string, data []byte) error {
	tmp, err := os.CreateTemp(filepath.Dir(path), ".tmp-"+filepath.Base(path))
	if err != nil {
		return err
	}
	if _, err := tmp.Write(data); err != nil {
		tmp.Close()
		os.Remove(tmp.Name())
		return err
	}
	if err := tmp.Close(); err != nil {
		os.Remove(tmp.Name())
		return err
	}
	return os.Rename(tmp.Name(), path)
}

// EtcdClient connects to etcd for raw reads and writes.
func EtcdClient(endpoints []string) (*clientv3.Client, error) {
	return clientv3.New(clientv3.Config{Endpoints: endpoints, DialTimeout: 5 * time.Second, Logger: zap.NewNop()})
}

// Upstream builds kube-apiserver's own transformers from an EncryptionConfiguration
// file with k8s.io/apiserver's encryptionconfig package: an independent implementation
// to check stored bytes against. Cancel ctx to stop its KMS clients.
//
// In a test process under GODEBUG=fips140=only upstream cannot build its aesgcm and
// KMS v2 transformers (cipher.NewGCM is refused there): Upstream then returns a Set
// rekey builds from the file afresh, independent of the process under test but not of
// rekey's code. The default build checks rekey against upstream; the e2e suite in FIPS
// mode runs its test process outside FIPS mode (REKEY_TESTBED_FIPS), with upstream.
func Upstream(ctx context.Context, configPath string) (value.ResourceTransformers, error) {
	if fips140.Enforced() {
		return rekeyTransformers(ctx, configPath)
	}
	cfg, err := encryptionconfig.LoadEncryptionConfig(ctx, configPath, false, "testbed")
	if err != nil {
		return nil, err
	}
	return encryptionconfig.StaticTransformers(cfg.Transformers), nil
}

// StorageCodec encodes and decodes core/v1 objects as kube-apiserver stores them
// (protobuf, k8s\x00 envelope).
type StorageCodec struct {
	codecs serializer.CodecFactory
}

// NewStorageCodec returns a codec for core/v1 Secrets and ConfigMaps.
func NewStorageCodec() *StorageCodec {
	s := runtime.NewScheme()
	if err := corev1.AddToScheme(s); err != nil {
		panic(err) // static registration
	}
	return &StorageCodec{codecs: serializer.NewCodecFactory(s)}
}

func (c *StorageCodec) protobuf() runtime.Serializer {
	info, ok := runtime.SerializerInfoForMediaType(c.codecs.SupportedMediaTypes(), runtime.ContentTypeProtobuf)
	if !ok {
		panic("no protobuf serializer")
	}
	return info.Serializer
}

// Decode decodes a stored plaintext value.
func (c *StorageCodec) Decode(data []byte) (runtime.Object, error) {
	obj, _, err := c.codecs.DecoderToVersion(c.protobuf(), corev1.SchemeGroupVersion).Decode(data, nil, nil)
	return obj, err
}

// Encode encodes obj as stored plaintext.
func (c *StorageCodec) Encode(obj runtime.Object) ([]byte, error) {
	return runtime.Encode(c.codecs.EncoderForVersion(c.protobuf(), corev1.SchemeGroupVersion), obj)
}

// ReadStored reads key from etcd and decrypts it with transformers for gr, returning
// the raw stored bytes and the decoded object.
func ReadStored(ctx context.Context, cli *clientv3.Client, t value.ResourceTransformers, gr schema.GroupResource, key string) (raw []byte, obj runtime.Object, err error) {
	resp, err := cli.Get(ctx, key)
	if err != nil {
		return nil, nil, err
	}
	if len(resp.Kvs) != 1 {
		return nil, nil, fmt.Errorf("etcd key %q: not found", key)
	}
	raw = resp.Kvs[0].Value
	plain, _, err := t.TransformerForResource(gr).TransformFromStorage(ctx, raw, value.DefaultContext(key))
	if err != nil {
		return raw, nil, fmt.Errorf("decrypting %q: %w", key, err)
	}
	obj, err = NewStorageCodec().Decode(plain)
	return raw, obj, err
}

// WriteStored encodes obj, encrypts it with transformers for gr and puts it at key.
func WriteStored(ctx context.Context, cli *clientv3.Client, t value.ResourceTransformers, gr schema.GroupResource, key string, obj runtime.Object) error {
	plain, err := NewStorageCodec().Encode(obj)
	if err != nil {
		return err
	}
	sealed, err := t.TransformerForResource(gr).TransformToStorage(ctx, plain, value.DefaultContext(key))
	if err != nil {
		return err
	}
	_, err = cli.Put(ctx, key, string(sealed))
	return err
}

// setTransformers is a rekey Set as value.ResourceTransformers.
type setTransformers struct{ set *transformers.Set }

func (s setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return s.set.TransformerFor(gr)
}

// rekeyTransformers builds a Set from configPath (Upstream under fips140=only); it is
// closed when ctx ends.
func rekeyTransformers(ctx context.Context, configPath string) (value.ResourceTransformers, error) {
	cfg, err := config.Load(configPath, config.Options{})
	if err != nil {
		return nil, err
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{})})
	if err != nil {
		return nil, err
	}
	for _, k := range set.KMSProviders() {
		if err := k.WaitReady(ctx); err != nil {
			set.Close()
			return nil, err
		}
	}
	context.AfterFunc(ctx, set.Close)
	return setTransformers{set}, nil
}
