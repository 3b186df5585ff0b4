package transformers_test

import (
	"context"
	"fmt"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"
)

// BenchmarkLocalProviders runs ours and upstream's transformers side by side, in one run
// and one process, for every local provider, payload size, direction and concurrency.
// Compare impl=rekey with impl=upstream of the same sub-benchmark (ratios, not absolutes:
// the machine is noisy). Reads use a value written by the same implementation.
//
//	go test -run '^$' -bench BenchmarkLocalProviders -benchmem ./pkg/transformers/
func BenchmarkLocalProviders(b *testing.B) {
	ctx := context.Background()
	// An interface value made once, so boxing the context is not counted per operation.
	var aad value.Context = value.DefaultContext("/registry/secrets/default/benchmark-secret")
	for _, provider := range []string{"identity", "aesgcm", "aescbc", "secretbox"} {
		p := loadPair(b, provider, configFor("secrets", provider))
		impls := []struct {
			name string
			t    value.Transformer
		}{{"rekey", p.our(secrets)}, {"upstream", p.up(secrets)}}
		for _, size := range []int{256, 4 << 10, 64 << 10} {
			plaintext := make([]byte, size)
			for i := range plaintext {
				plaintext[i] = byte(i)
			}
			for _, mode := range []string{"serial", "parallel"} {
				for _, op := range []string{"write", "read"} {
					for _, impl := range impls {
						stored, err := impl.t.TransformToStorage(ctx, plaintext, aad)
						if err != nil {
							b.Fatal(err)
						}
						name := fmt.Sprintf("provider=%s/op=%s/size=%d/mode=%s/impl=%s", provider, op, size, mode, impl.name)
						b.Run(name, func(b *testing.B) {
							b.ReportAllocs()
							b.SetBytes(int64(size))
							run := func() {
								var err error
								if op == "write" {
									_, err = impl.t.TransformToStorage(ctx, plaintext, aad)
								} else {
									_, _, err = impl.t.TransformFromStorage(ctx, stored, aad)
								}
								if err != nil {
									b.Fatal(err)
								}
							}
							if mode == "serial" {
								for b.Loop() {
									run()
								}
								return
							}
							b.RunParallel(func(pb *testing.PB) {
								for pb.Next() {
									run()
								}
							})
						})
					}
				}
			}
		}
	}
}
