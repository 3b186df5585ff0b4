package reload

import (
	"context"
	"path/filepath"
	"testing"

	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
)

// BenchmarkAgentOverhead compares a write through the Agent (what an apiserver calls)
// with the same write on the Set's chain directly: the difference is the price of
// hot reload on every call.
func BenchmarkAgentOverhead(b *testing.B) {
	path := filepath.Join(b.TempDir(), "enc.yaml")
	writeRename(b, path, secretsConfig("aesgcm:k0"))
	agent, err := NewAgent(context.Background(), Options{Path: path, Logger: quiet})
	if err != nil {
		b.Fatal(err)
	}
	defer agent.Close()
	gr := schema.GroupResource{Resource: "secrets"}
	ctx := context.Background()
	var aad value.Context = value.DefaultContext("/registry/secrets/ns/name")
	pt := make([]byte, 256)
	for _, c := range []struct {
		name string
		t    value.Transformer
	}{{"via=agent", agent.TransformerForResource(gr)}, {"via=set", agent.acquire().set.TransformerFor(gr)}} {
		for _, parallel := range []bool{false, true} {
			mode := "serial"
			if parallel {
				mode = "parallel"
			}
			b.Run(c.name+"/mode="+mode, func(b *testing.B) {
				b.ReportAllocs()
				op := func() {
					if _, err := c.t.TransformToStorage(ctx, pt, aad); err != nil {
						b.Fatal(err)
					}
				}
				if !parallel {
					for b.Loop() {
						op()
					}
					return
				}
				b.RunParallel(func(pb *testing.PB) {
					for pb.Next() {
						op()
					}
				})
			})
		}
	}
}
