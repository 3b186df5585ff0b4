package bench

import (
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"time"

	"k8s.io/apiserver/pkg/storage/value"
	upstreamkmsv2 "k8s.io/apiserver/pkg/storage/value/encrypt/envelope/kmsv2"
	"k8s.io/component-base/metrics"
	kmsservice "k8s.io/kms/pkg/service"

	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/client"
)

// kmsPair builds a KMS v2 config both ways and waits until rekey can write (upstream's
// loader primes its DEK before returning).
func (e *kmsEnv) kmsPair(name string) (*LocalPair, error) {
	pair, err := BuildPair(e.yaml(name), transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: metrics.NewKubeRegistry()})})
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	var aad value.Context = value.DefaultContext("/registry/secrets/ns/ready")
	for {
		if _, err := pair.Rekey.TransformToStorage(ctx, []byte("x"), aad); err == nil {
			return pair, nil
		}
		select {
		case <-ctx.Done():
			pair.Close()
			return nil, errors.New("rekey KMS v2 provider not ready within 10s")
		case <-time.After(5 * time.Millisecond):
		}
	}
}

// kmsNames returns a fresh provider name: every new provider gets its own seed (DEK).
func kmsNames() string {
	b := make([]byte, 4)
	_, _ = rand.Read(b)
	return fmt.Sprintf("bench-kms-%x", b)
}

// freshPair holds a KMS v2 pair that can be rebuilt under the same provider name (so
// values written earlier stay readable). Upstream keeps an entry per write in its 24-hour
// cache; rebuilding before every sample keeps that heap from slowing the next sample of
// either implementation.
type freshPair struct {
	env  *kmsEnv
	name string
	cur  *LocalPair
}

func (f *freshPair) reset() error {
	p, err := f.env.kmsPair(f.name)
	if err != nil {
		return err
	}
	if f.cur != nil {
		f.cur.Close()
	}
	f.cur = p
	return nil
}

func (f *freshPair) close() {
	if f.cur != nil {
		f.cur.Close()
	}
}

func runKMS(s Settings) ([]Row, error) {
	env, err := startKMS()
	if err != nil {
		return nil, err
	}
	defer env.close()
	pair := &freshPair{env: env, name: kmsNames()}
	if err := pair.reset(); err != nil {
		return nil, err
	}
	defer pair.close()

	ctx := context.Background()
	aadBytes := []byte("/registry/secrets/default/benchmark-secret")
	var aad value.Context = value.DefaultContext(aadBytes)
	raw := NewRawGCM()
	var cases []OpCase
	modes := []string{"serial", "parallel"}
	if s.Short {
		modes = []string{"serial"}
	}
	for _, mode := range modes {
		for _, op := range []string{"write", "read"} {
			for _, size := range []int{256, 4 << 10, 64 << 10} {
				pt := make([]byte, size)
				ours, err := pair.cur.Rekey.TransformToStorage(ctx, pt, aad)
				if err != nil {
					return nil, err
				}
				theirs, err := pair.cur.Upstream.TransformToStorage(ctx, pt, aad)
				if err != nil {
					return nil, err
				}
				rawStored := raw.Seal(pt, aadBytes)
				mk := func(upstream bool, stored []byte) Op {
					t := func() value.Transformer {
						if upstream {
							return pair.cur.Upstream
						}
						return pair.cur.Rekey
					}
					if op == "write" {
						return func() error { _, err := t().TransformToStorage(ctx, pt, aad); return err }
					}
					return func() error { _, _, err := t().TransformFromStorage(ctx, stored, aad); return err }
				}
				rawOp := func() error { raw.Seal(pt, aadBytes); return nil }
				if op == "read" {
					rawOp = func() error { _, err := raw.Open(rawStored, aadBytes); return err }
				}
				c := OpCase{
					Scenario: "kms v2 transform",
					Case:     fmt.Sprintf("%s %s %s (warm DEK cache)", op, sizeLabel(size), mode),
					Plots:    kmsPlots(op, size, mode),
					Impls: []Impl{
						{Name: "rekey", Op: mk(false, ours), Reset: pair.reset},
						{Name: "upstream", Op: mk(true, theirs), Reset: pair.reset},
						{Name: "raw AES-256-GCM", Op: rawOp},
					},
					Parallel: mode == "parallel",
				}
				switch {
				case size <= 4<<10 && op == "write":
					c.Targets = []Target{{Desc: "write ≥8× upstream, ≤4 allocs", Against: 1, MinSpeedup: 8, MaxAllocs: 4}}
				case size <= 4<<10:
					c.Targets = []Target{{Desc: "read ≥5× upstream, ≤4 allocs", Against: 1, MinSpeedup: 5, MaxAllocs: 4}}
				default:
					c.Targets = []Target{{Desc: "within 1.5× of raw AES-GCM, 1 alloc", Against: 2, MinSpeedup: 1 / 1.5, MaxAllocs: 1}}
				}
				cases = append(cases, c)
			}
		}
	}
	rows, err := RunOpCases(s, cases)
	if err != nil {
		return nil, err
	}
	grpcRows, err := kmsGRPCRows(s, env)
	if err != nil {
		return nil, err
	}
	rows = append(rows, grpcRows...)
	storm, err := kmsColdStorm(s, env)
	if err != nil {
		return nil, err
	}
	rows = append(rows, storm...)
	if err := pair.reset(); err != nil {
		return nil, err
	}
	retained, err := kmsRetained(s, pair.cur)
	if err != nil {
		return nil, err
	}
	return append(rows, retained), nil
}

// kmsGRPCRows times one RPC of each method through rekey's client and upstream's.
func kmsGRPCRows(s Settings, env *kmsEnv) ([]Row, error) {
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	m := kmsv2.NewMetrics(metrics.NewKubeRegistry())
	ours, err := client.New(env.endpoint, 3*time.Second, m.RPCRecorder("bench"))
	if err != nil {
		return nil, err
	}
	defer ours.Close()
	theirs, err := upstreamkmsv2.NewGRPCService(ctx, env.endpoint, "bench", 3*time.Second)
	if err != nil {
		return nil, err
	}
	enc, err := ours.Encrypt(ctx, "uid", make([]byte, 32))
	if err != nil {
		return nil, err
	}
	dek := make([]byte, 32)
	cases := []OpCase{
		{Scenario: "kms v2 gRPC", Case: "Status", Plots: grpcPlot("Status"), Impls: []Impl{
			{Name: "rekey", Op: func() error { _, err := ours.Status(ctx); return err }},
			{Name: "upstream", Op: func() error { _, err := theirs.Status(ctx); return err }},
		}},
		{Scenario: "kms v2 gRPC", Case: "Encrypt (32 B)", Plots: grpcPlot("Encrypt"), Impls: []Impl{
			{Name: "rekey", Op: func() error { _, err := ours.Encrypt(ctx, "uid", dek); return err }},
			{Name: "upstream", Op: func() error { _, err := theirs.Encrypt(ctx, "uid", dek); return err }},
		}},
		{Scenario: "kms v2 gRPC", Case: "Decrypt", Plots: grpcPlot("Decrypt"), Impls: []Impl{
			{Name: "rekey", Op: func() error {
				_, err := ours.Decrypt(ctx, "uid", enc.KeyID, enc.Ciphertext, enc.Annotations)
				return err
			}},
			{Name: "upstream", Op: func() error {
				_, err := theirs.Decrypt(ctx, "uid", &kmsservice.DecryptRequest{Ciphertext: enc.Ciphertext, KeyID: enc.KeyID, Annotations: enc.Annotations})
				return err
			}},
		}},
	}
	for i := range cases {
		// No slower than upstream, with 5% for a noisy shared machine.
		cases[i].Targets = []Target{{Desc: noSlower, Against: 1, MinSpeedup: noiseFloor}}
	}
	return RunOpCases(s, cases)
}

// kmsColdStorm writes 10,000 objects under 10 DEKs (ten writer instances, each with its
// own seed), then times a fresh instance of each implementation reading all of them:
// 10 Decrypt RPCs plus one key derivation per object for both.
func kmsColdStorm(s Settings, env *kmsEnv) ([]Row, error) {
	const writers = 10
	perWriter := 1000
	if s.Short {
		perWriter = 200
	}
	ctx := context.Background()
	type obj struct {
		aad  value.Context
		data []byte
	}
	var objs []obj
	pt := make([]byte, 256)
	for w := 0; w < writers; w++ {
		wp, err := env.kmsPair(kmsNames())
		if err != nil {
			return nil, err
		}
		for i := 0; i < perWriter; i++ {
			aad := value.DefaultContext(fmt.Sprintf("/registry/secrets/ns/obj-%d-%d", w, i))
			// Upstream writes (one seed per writer instance) so both readers do the
			// same work; every one of these values needs a key derivation to read.
			data, err := wp.Upstream.TransformToStorage(ctx, pt, aad)
			if err != nil {
				wp.Close()
				return nil, err
			}
			objs = append(objs, obj{aad, data})
		}
		wp.Close()
	}
	// Every reader must use the same provider name as the writers' prefix: the
	// stored prefix names the provider, so read with a config named like each writer.
	// Instead of ten configs, strip and re-prefix: the prefix is not authenticated.
	rounds := s.Rounds
	ours := make([]float64, 0, rounds)
	theirs := make([]float64, 0, rounds)
	for r := 0; r < rounds; r++ {
		name := kmsNames()
		reader, err := env.kmsPair(name)
		if err != nil {
			return nil, err
		}
		prefix := []byte("k8s:enc:kms:v2:" + name + ":")
		renamed := make([][]byte, len(objs))
		for i, o := range objs {
			renamed[i] = append(append([]byte{}, prefix...), o.data[prefixLen(o.data):]...)
		}
		for k, t := range []value.Transformer{reader.Rekey, reader.Upstream} {
			start := time.Now()
			for i, o := range objs {
				if _, _, err := t.TransformFromStorage(ctx, renamed[i], o.aad); err != nil {
					reader.Close()
					return nil, fmt.Errorf("cold read %d: %w", i, err)
				}
			}
			ms := float64(time.Since(start).Microseconds()) / 1000
			if k == 0 {
				ours = append(ours, ms)
			} else {
				theirs = append(theirs, ms)
			}
		}
		reader.Close()
	}
	row := Row{Scenario: "kms v2 cold DEK cache", Case: fmt.Sprintf("read %d objects under %d DEKs, fresh reader", len(objs), writers),
		Plots: []Plot{headlinePlot(fmt.Sprintf("cold cache:\n%d reads", len(objs)))},
		Figures: []Figure{
			wholeRunFigure("rekey", "ms", summarize(ours), false),
			wholeRunFigure("upstream", "ms", summarize(theirs), false),
		}}
	row.Checks = []Check{evaluate(row, Target{Desc: noSlower, Against: 1, MinSpeedup: noiseFloor})}
	if s.Progress != nil {
		fmt.Fprintf(s.Progress, "kms cold storm: rekey %.1f ms, upstream %.1f ms\n", row.Figures[0].Stats.Median, row.Figures[1].Stats.Median)
	}
	return []Row{row}, nil
}

// prefixLen is the length of "k8s:enc:kms:v2:<name>:".
func prefixLen(v []byte) int {
	colons := 0
	for i, c := range v {
		if c == ':' {
			colons++
			if colons == 5 {
				return i + 1
			}
		}
	}
	return 0
}

// kmsRetained: heap still held after many 256-byte writes (upstream keeps an entry per
// write in its expiring cache for 24 h).
func kmsRetained(s Settings, pair *LocalPair) (Row, error) {
	n := 200_000
	if s.Short {
		n = 50_000
	}
	ctx := context.Background()
	var aad value.Context = value.DefaultContext("/registry/secrets/default/retained")
	pt := make([]byte, 256)
	row := Row{Scenario: "kms v2 retained heap", Case: fmt.Sprintf("%d writes of 256 B", n)}
	for _, im := range []struct {
		name string
		t    value.Transformer
	}{{"rekey", pair.Rekey}, {"upstream", pair.Upstream}} {
		b, err := RetainedHeap(n, func() error { _, err := im.t.TransformToStorage(ctx, pt, aad); return err }, im.t)
		if err != nil {
			return row, err
		}
		b = max(b, 0) // the heap can shrink by a GC's worth of noise
		row.Figures = append(row.Figures, Figure{Impl: im.name, Unit: "B", Stats: single(b), Allocs: -1, Bytes: -1, Retained: b})
	}
	ok := row.Figures[0].Stats.Median <= float64(n)/1_000_000*(1<<20) // ≤ 1 MB per million writes
	row.Checks = []Check{{Desc: "≤1 MB per 1,000,000 writes", Met: ok, Got: fmt.Sprintf("%.0f B", row.Figures[0].Stats.Median)}}
	return row, nil
}

// kmsPlots draws a KMS v2 case on the KMS v2 chart, its serial cases also on the
// cipher-floor chart and the serial 256 B and 4 KiB ones on the headline chart.
func kmsPlots(op string, size int, mode string) []Plot {
	x := op + "\n" + sizeLabel(size)
	out := []Plot{{Chart: "kms-v2", Title: "KMS v2 (warm DEK cache): rekey vs upstream, per write and read", X: x, Series: mode, Against: 1}}
	if mode == "serial" {
		out = append(out, cipherFloorPlot(x, "KMS v2"))
		if size <= 4<<10 {
			out = append(out, headlinePlot("KMS v2 "+op+"\n"+sizeLabel(size)))
		}
	}
	return out
}

func grpcPlot(x string) []Plot {
	return []Plot{{Chart: "kms-v2-grpc", Title: "KMS v2 gRPC round trips to the same plugin: rekey's client vs upstream's", X: x, Series: "unix socket", Against: 1}}
}
