package migrate

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
)

// TestMigrateNeverRewritesAWrongKeyRead: aescbc keys "a" and "a:bcdefghijklmnop" (15
// characters after "a:", so the long key's values stay block-aligned after the short
// prefix). 3,000 objects are stored under the long key; the new configuration writes
// with aesgcm and reads aescbc with the short key listed first. Opened with the short key, a long-key value "decrypts" to garbage
// with valid padding about once in 256 values — upstream's read order does exactly
// that, and a migration that trusted it would re-encrypt the garbage under the write
// key: permanent loss. The first objects are seeded to be such values. Every object
// must keep its plaintext.
func TestMigrateNeverRewritesAWrongKeyRead(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	const long = "a:bcdefghijklmnop"
	_, writer := setFor(t, "secrets", "aescbc:"+long)
	_, shortOnly := setFor(t, "secrets", "aescbc:a")
	_, next := setFor(t, "secrets", "aesgcm:new", "aescbc:a,"+long)
	tr := writer.TransformerFor(secrets)

	const n, seeded = 3000, 8
	want := map[string][]byte{}
	var ops []clientv3.Op
	for i := 0; i < n; i++ {
		key := keyOf(secrets, fmt.Sprintf("ns%d", i%10), fmt.Sprintf("obj-%06d", i))
		pt := plaintextFor(key, 0)
		var stored []byte
		for attempt := 0; ; attempt++ {
			out, err := tr.TransformToStorage(ctx, pt, value.DefaultContext(key))
			if err != nil {
				t.Fatal(err)
			}
			stored = out
			if i >= seeded {
				break
			}
			// Seeded objects: keep encrypting (fresh random IV) until the short key
			// "reads" the value without error.
			garbage, _, err := shortOnly.TransformerFor(secrets).TransformFromStorage(ctx, out, value.DefaultContext(key))
			if err == nil && !bytes.Equal(garbage, pt) {
				break
			}
			if attempt > 100_000 {
				t.Fatal("could not find a value the short key reads with valid padding")
			}
		}
		want[key] = pt
		ops = append(ops, clientv3.OpPut(key, string(stored)))
		if len(ops) == 100 {
			if _, err := cli.Txn(ctx).Then(ops...).Commit(); err != nil {
				t.Fatal(err)
			}
			ops = ops[:0]
		}
	}

	res, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)}, PageSize: 128})
	if err != nil {
		t.Fatalf("migration: %v (result %+v)", err, res)
	}
	// Read back with the long key listed first, which upstream also reads correctly.
	_, check := setFor(t, "secrets", "aesgcm:new", "aescbc:"+long+",a")
	changed := 0
	for key, pt := range want {
		resp, err := cli.Get(ctx, key)
		if err != nil {
			t.Fatal(err)
		}
		got, _, err := check.TransformerFor(secrets).TransformFromStorage(ctx, resp.Kvs[0].Value, value.DefaultContext(key))
		if err != nil || !bytes.Equal(got, pt) {
			changed++
		}
	}
	if changed > 0 {
		t.Fatalf("%d of %d objects lost their plaintext in the migration (result %+v)", changed, n, res)
	}
	if res.Rewritten != n {
		t.Fatalf("result = %+v, want %d rewritten", res, n)
	}
}

// garbling serves a Source whose transformer reads every value as stale garbage, as a
// wrong MAC-less key would.
type garbling struct{ Source }

func (g garbling) TransformerFor(gr schema.GroupResource) value.Transformer {
	return garbleReads{g.Source.TransformerFor(gr)}
}

type garbleReads struct{ value.Transformer }

func (g garbleReads) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	out, _, err := g.Transformer.TransformFromStorage(ctx, data, dataCtx)
	if err != nil {
		return nil, false, err
	}
	garbage := bytes.Clone(out)
	for i := range garbage {
		garbage[i] ^= 0x5a
	}
	return garbage, true, nil
}

// TestMigrateRefusesToRewriteWhatIsNotAnObject: whatever the transformers return, a
// stale value whose plaintext is not a stored Kubernetes object is counted unreadable
// and never written.
func TestMigrateRefusesToRewriteWhatIsNotAnObject(t *testing.T) {
	ctx := context.Background()
	cli := startEtcd(t)
	_, old := setFor(t, "secrets", "aesgcm:key1")
	keys := writeObjects(t, cli, old, secrets, 50)
	_, next := setFor(t, "secrets", "aesgcm:key2,key1")
	revBefore := currentRev(t, cli)
	res, err := Migrate(ctx, Options{Client: cli, Source: garbling{FromSet(next)}, Resources: []Resource{ResourceFor(DefaultEtcdPrefix, secrets)}})
	if !errors.Is(err, ErrNotFinished) {
		t.Fatalf("migration err = %v, want ErrNotFinished", err)
	}
	if res.Rewritten != 0 || res.Unreadable != 50 {
		t.Fatalf("result = %+v, want 0 rewritten, 50 unreadable", res)
	}
	if rev := currentRev(t, cli); rev != revBefore {
		t.Fatalf("the migration wrote to etcd: revision %d → %d", revBefore, rev)
	}
	for _, k := range keys {
		if plain, _, _ := readPlain(t, cli, old, secrets, k); !bytes.Equal(plain, plaintextFor(k, 0)) {
			t.Fatalf("%s changed", k)
		}
	}
}
