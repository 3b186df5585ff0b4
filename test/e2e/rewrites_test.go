package e2e

import (
	"bytes"
	"context"
	"sync/atomic"
	"testing"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// countRewritesInPlace watches the Secrets under prefix and counts the writes that
// stored, under stored, the same plaintext the value already held under stored: a
// migration rewriting an object it (or a leader before it) had already moved. A
// client's update changes the plaintext, so the writers' traffic is not counted. The
// count is read with the returned function; the watch ends with ctx.
func countRewritesInPlace(ctx context.Context, t *testing.T, cli *clientv3.Client, prefix, stored string, key testbed.NamedKey) func() int64 {
	t.Helper()
	cfg, err := config.Parse(testbed.SecretsConfig(testbed.AESGCM(key)).Render(), "rewrites", config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	set, err := transformers.Build(ctx, cfg, transformers.Options{})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(set.Close)
	tr := set.TransformerFor(schema.GroupResource{Resource: "secrets"})
	var n atomic.Int64
	go func() {
		for resp := range cli.Watch(ctx, prefix, clientv3.WithPrefix(), clientv3.WithPrevKV()) {
			for _, ev := range resp.Events {
				if ev.Type != clientv3.EventTypePut || ev.PrevKv == nil ||
					!bytes.HasPrefix(ev.Kv.Value, []byte(stored)) || !bytes.HasPrefix(ev.PrevKv.Value, []byte(stored)) {
					continue
				}
				dctx := value.DefaultContext(ev.Kv.Key)
				before, _, err1 := tr.TransformFromStorage(ctx, ev.PrevKv.Value, dctx)
				after, _, err2 := tr.TransformFromStorage(ctx, ev.Kv.Value, dctx)
				if err1 == nil && err2 == nil && bytes.Equal(before, after) {
					n.Add(1)
				}
			}
		}
	}()
	return n.Load
}
