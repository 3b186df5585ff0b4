package bench

import (
	"context"
	"fmt"
	"os"
	"path/filepath"

	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// runTransform measures every local provider, then the reload path, then the heap each
// implementation retains.
func runTransform(s Settings) ([]Row, error) {
	cases, closers, err := TransformCases(s)
	defer func() {
		for _, c := range closers {
			c()
		}
	}()
	if err != nil {
		return nil, err
	}
	agentCases, agentClosers, err := AgentCases(s)
	closers = append(closers, agentClosers...)
	if err != nil {
		return nil, err
	}
	rows, err := RunOpCases(s, append(cases, agentCases...))
	if err != nil {
		return nil, err
	}
	n := 100_000
	if s.Short {
		n = 20_000
	}
	retained, err := TransformRetained(n)
	if err != nil {
		return nil, err
	}
	return append(rows, retained...), nil
}

// TransformCases builds the transform scenario: every local provider × size ×
// serial/parallel × write/read, rekey vs upstream vs raw AES-256-GCM.
func TransformCases(s Settings) ([]OpCase, []func(), error) {
	sizes := []int{256, 4 << 10, 64 << 10, 1 << 20}
	if s.Short {
		sizes = []int{256, 4 << 10, 64 << 10}
	}
	ctx := context.Background()
	aadBytes := []byte("/registry/secrets/default/benchmark-secret")
	var aad value.Context = value.DefaultContext(aadBytes)
	raw := NewRawGCM()
	var cases []OpCase
	var closers []func()
	for _, provider := range []string{"identity", "aesgcm", "aescbc", "secretbox"} {
		pair, err := BuildPair(LocalProviderYAML(provider), transformers.Options{})
		if err != nil {
			return nil, closers, err
		}
		closers = append(closers, pair.Close)
		for _, mode := range []string{"serial", "parallel"} {
			for _, op := range []string{"write", "read"} {
				for _, size := range sizes {
					pt := make([]byte, size)
					for i := range pt {
						pt[i] = byte(i * 7)
					}
					rekeyStored, err := pair.Rekey.TransformToStorage(ctx, pt, aad)
					if err != nil {
						return nil, closers, err
					}
					upStored, err := pair.Upstream.TransformToStorage(ctx, pt, aad)
					if err != nil {
						return nil, closers, err
					}
					rawStored := raw.Seal(pt, aadBytes)
					mk := func(t value.Transformer, stored []byte) Op {
						if op == "write" {
							return func() error { _, err := t.TransformToStorage(ctx, pt, aad); return err }
						}
						return func() error { _, _, err := t.TransformFromStorage(ctx, stored, aad); return err }
					}
					rawOp := func() error { raw.Seal(pt, aadBytes); return nil }
					if op == "read" {
						rawOp = func() error { _, err := raw.Open(rawStored, aadBytes); return err }
					}
					c := OpCase{
						Scenario: "transform",
						Case:     fmt.Sprintf("%s %s %s %s", provider, op, sizeLabel(size), mode),
						Plots:    transformPlots(provider, op, size, mode),
						Impls: []Impl{
							{Name: "rekey", Op: mk(pair.Rekey, rekeyStored)},
							{Name: "upstream", Op: mk(pair.Upstream, upStored)},
							{Name: "raw AES-256-GCM", Op: rawOp},
						},
						Parallel: mode == "parallel",
					}
					if size <= 4<<10 {
						c.Targets = append(c.Targets, Target{Desc: "≥2× upstream, ≤2 allocs", Against: 1, MinSpeedup: 2, MaxAllocs: 2})
					} else {
						c.Targets = append(c.Targets, Target{Desc: noSlower, Against: 1, MinSpeedup: noiseFloor})
					}
					cases = append(cases, c)
				}
			}
		}
	}
	return cases, closers, nil
}

// TransformRetained measures the heap each implementation still holds after n writes of
// 256 bytes per local provider.
func TransformRetained(n int) ([]Row, error) {
	ctx := context.Background()
	var aad value.Context = value.DefaultContext("/registry/secrets/default/retained")
	pt := make([]byte, 256)
	var rows []Row
	for _, provider := range []string{"identity", "aesgcm", "aescbc", "secretbox"} {
		pair, err := BuildPair(LocalProviderYAML(provider), transformers.Options{})
		if err != nil {
			return nil, err
		}
		row := Row{Scenario: "transform retained heap", Case: fmt.Sprintf("%s: %d writes of 256 B", provider, n)}
		for _, im := range []struct {
			name string
			t    value.Transformer
		}{{"rekey", pair.Rekey}, {"upstream", pair.Upstream}} {
			b, err := RetainedHeap(n, func() error { _, err := im.t.TransformToStorage(ctx, pt, aad); return err }, im.t)
			if err != nil {
				pair.Close()
				return nil, err
			}
			if b < 0 {
				b = 0
			}
			row.Figures = append(row.Figures, Figure{Impl: im.name, Unit: "B", Stats: single(b), Allocs: -1, Bytes: -1, Retained: b})
		}
		pair.Close()
		rows = append(rows, row)
	}
	return rows, nil
}

// AgentCases measures what an apiserver embedding rekey actually calls: the reload
// Agent's per-resource transformer (current configuration loaded per call, calls counted
// so a replaced Set drains before it closes) against upstream's reload path
// (DynamicTransformers), both with aesgcm.
func AgentCases(s Settings) ([]OpCase, []func(), error) {
	dir, err := os.MkdirTemp("", "rka")
	if err != nil {
		return nil, nil, err
	}
	closers := []func(){func() { os.RemoveAll(dir) }}
	path := filepath.Join(dir, "enc.yaml")
	if err := os.WriteFile(path, []byte(LocalProviderYAML("aesgcm")), 0o600); err != nil {
		return nil, closers, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	closers = append(closers, cancel)
	agent, err := reload.NewAgent(ctx, reload.Options{Path: path, Logger: klog.Background().V(10)})
	if err != nil {
		return nil, closers, err
	}
	closers = append(closers, agent.Close)
	up, err := encryptionconfig.LoadEncryptionConfig(ctx, path, true, "bench")
	if err != nil {
		return nil, closers, err
	}
	dyn := encryptionconfig.NewDynamicTransformers(up.Transformers, up.HealthChecks[0], cancel, up.KMSCloseGracePeriod)
	ours, theirs := agent.TransformerForResource(secretsGR), dyn.TransformerForResource(secretsGR)
	var aad value.Context = value.DefaultContext("/registry/secrets/default/benchmark-secret")
	var cases []OpCase
	for _, mode := range []string{"serial", "parallel"} {
		for _, op := range []string{"write", "read"} {
			for _, size := range []int{256, 4 << 10} {
				pt := make([]byte, size)
				oursStored, err := ours.TransformToStorage(ctx, pt, aad)
				if err != nil {
					return nil, closers, err
				}
				theirsStored, err := theirs.TransformToStorage(ctx, pt, aad)
				if err != nil {
					return nil, closers, err
				}
				mk := func(t value.Transformer, stored []byte) Op {
					if op == "write" {
						return func() error { _, err := t.TransformToStorage(ctx, pt, aad); return err }
					}
					return func() error { _, _, err := t.TransformFromStorage(ctx, stored, aad); return err }
				}
				cases = append(cases, OpCase{
					Scenario: "transform through the reload path (aesgcm)",
					Case:     fmt.Sprintf("%s %s %s: reload.Agent vs DynamicTransformers", op, sizeLabel(size), mode),
					Plots: []Plot{{Chart: "reload-path", Title: "aesgcm through the reload path: reload.Agent vs upstream's DynamicTransformers",
						X: op + "\n" + sizeLabel(size), Series: mode, Against: 1}},
					Impls: []Impl{
						{Name: "rekey", Op: mk(ours, oursStored)},
						{Name: "upstream", Op: mk(theirs, theirsStored)},
					},
					Parallel: mode == "parallel",
				})
			}
		}
	}
	return cases, closers, nil
}

// transformPlots draws a local provider's case on the provider's chart (write/read ×
// size, serial and parallel, against upstream) and aesgcm's serial cases also on the
// cipher-floor chart (against raw AES-256-GCM, index 2).
func transformPlots(provider, op string, size int, mode string) []Plot {
	x := op + "\n" + sizeLabel(size)
	out := []Plot{{Chart: "transform-" + provider, Title: provider + ": rekey vs upstream, per write and read", X: x, Series: mode, Against: 1}}
	if provider == "aesgcm" && mode == "serial" {
		out = append(out, cipherFloorPlot(x, "aesgcm"))
	}
	return out
}
