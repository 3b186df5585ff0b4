package transformers_test

import (
	"bytes"
	"context"
	"fmt"
	"testing"

	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/compatconfigs"
	"github.com/rekey-io/rekey/internal/enctest"
	"github.com/rekey-io/rekey/pkg/transformers"
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
		// impl=rekey-counted is impl=rekey with the per-key write counter on
		// (transformers.Options.WriteCounts, as every apiserver runs it): the two side by
		// side are the counter's cost.
		counted := buildCounted(b, configFor("secrets", provider), transformers.NewWriteCounts())
		impls := []struct {
			name string
			t    value.Transformer
		}{{"rekey", p.our(secrets)}, {"rekey-counted", counted.TransformerFor(secrets)}, {"upstream", p.up(secrets)}}
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
							loop(b, mode, run)
						})
					}
				}
			}
		}
	}
}

// BenchmarkKMSv1Read reads a KMS v1 value upstream wrote (AES-GCM data, as Kubernetes
// 1.25 and later write it) with ours and upstream's transformers side by side, for a
// configuration that writes with aesgcm and keeps the v1 provider behind it. The
// value's DEK is cached after the first read on both sides, so this is the read path
// of a migration's second look or an apiserver serving old values, not the plugin.
//
//	go test -run '^$' -bench BenchmarkKMSv1Read -benchmem ./pkg/transformers/
func BenchmarkKMSv1Read(b *testing.B) {
	upstreamKMSv1(b)
	ctx := context.Background()
	var aad value.Context = value.DefaultContext("/registry/secrets/default/benchmark-secret")
	plugin := enctest.StartKMSv1(b, "kek1")
	yaml := "apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n" +
		compatconfigs.ProviderYAML["aesgcm"] + kmsv1YAML(plugin, "old")
	p := loadPair(b, "aesgcm,kmsv1", yaml)
	writer := enctest.UpstreamKMSv1(b, plugin.Endpoint(), "old", false)
	impls := []struct {
		name string
		t    value.Transformer
	}{{"rekey", p.our(secrets)}, {"upstream", p.up(secrets)}}
	for _, size := range []int{256, 4 << 10, 64 << 10} {
		plaintext := bytes.Repeat([]byte{0x5a}, size)
		stored, err := writer.TransformToStorage(ctx, plaintext, aad)
		if err != nil {
			b.Fatal(err)
		}
		for _, mode := range []string{"serial", "parallel"} {
			for _, impl := range impls {
				if _, _, err := impl.t.TransformFromStorage(ctx, stored, aad); err != nil {
					b.Fatal(err) // also fills the DEK cache
				}
				b.Run(fmt.Sprintf("size=%d/mode=%s/impl=%s", size, mode, impl.name), func(b *testing.B) {
					b.ReportAllocs()
					b.SetBytes(int64(size))
					read := func() {
						if _, _, err := impl.t.TransformFromStorage(ctx, stored, aad); err != nil {
							b.Fatal(err)
						}
					}
					loop(b, mode, read)
				})
			}
		}
	}
}

// loop runs op b.N times, in one goroutine (mode "serial") or in GOMAXPROCS of them.
func loop(b *testing.B, mode string, op func()) {
	if mode == "serial" {
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
}
