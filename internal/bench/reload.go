package bench

import (
	"bytes"
	"context"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"time"

	"k8s.io/apiserver/pkg/server/options/encryptionconfig"
	"k8s.io/apiserver/pkg/server/options/encryptionconfig/controller"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/component-base/metrics"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/reload"
	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2"
)

// writeRename replaces path the way config management does: write a temp file, rename.
func writeRename(path, content string) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, []byte(content), 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

// waitForPrefix writes through t until the stored value starts with prefix and returns
// how long that took from start.
func waitForPrefix(t value.Transformer, prefix string, start time.Time, limit time.Duration) (time.Duration, error) {
	ctx := context.Background()
	var aad value.Context = value.DefaultContext("/registry/secrets/ns/reload")
	for {
		out, err := t.TransformToStorage(ctx, []byte("x"), aad)
		if err == nil && bytes.HasPrefix(out, []byte(prefix)) {
			return time.Since(start), nil
		}
		if time.Since(start) > limit {
			return 0, fmt.Errorf("writes did not switch to %q within %v", prefix, limit)
		}
		time.Sleep(200 * time.Microsecond)
	}
}

func aesgcmConfig(keyName string) string {
	return fmt.Sprintf("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - aesgcm:\n          keys:\n            - {name: %s, secret: %s}\n", keyName, randomKey(32))
}

// runReload measures the time from the rename of a new config to the first write that
// uses it: rekey's agent (many samples, local providers and a new KMS v2 provider) and
// upstream's controller with its default 1-minute poll (a few samples; none in short mode).
func runReload(s Settings) ([]Row, error) {
	dir, err := os.MkdirTemp("", "rkr")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(dir)
	env, err := startKMS()
	if err != nil {
		return nil, err
	}
	defer env.close()

	localSamples, kmsSamples, upstreamSamples := 200, 50, 3
	if s.Short {
		localSamples, kmsSamples, upstreamSamples = 50, 15, 0
	}
	path := filepath.Join(dir, "enc.yaml")
	if err := writeRename(path, aesgcmConfig("k0")); err != nil {
		return nil, err
	}
	agent, err := reload.NewAgent(context.Background(), reload.Options{
		Path: path, AutomaticReload: true, GracePeriod: time.Second,
		Transformers: transformers.Options{KMS: kmsv2.NewFactory(kmsv2.FactoryOptions{Registry: metrics.NewKubeRegistry()}), Logger: klog.Background().V(10)},
		Registry:     metrics.NewKubeRegistry(), Logger: klog.Background().V(10),
	})
	if err != nil {
		return nil, err
	}
	defer agent.Close()
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { defer close(done); agent.Run(ctx) }()
	defer func() { cancel(); <-done }()
	tr := agent.TransformerForResource(secretsGR)

	measureOurs := func(n int, next func(i int) (string, string)) ([]float64, error) {
		var ms []float64
		for i := 1; i <= n; i++ {
			content, prefix := next(i)
			start := time.Now()
			if err := writeRename(path, content); err != nil {
				return nil, err
			}
			d, err := waitForPrefix(tr, prefix, start, 30*time.Second)
			if err != nil {
				return nil, err
			}
			ms = append(ms, float64(d.Microseconds())/1000)
		}
		return ms, nil
	}
	local, err := measureOurs(localSamples, func(i int) (string, string) {
		name := fmt.Sprintf("k%d", i)
		return aesgcmConfig(name), "k8s:enc:aesgcm:v1:" + name + ":"
	})
	if err != nil {
		return nil, err
	}
	kms, err := measureOurs(kmsSamples, func(i int) (string, string) {
		name := fmt.Sprintf("reload-kms-%d", i)
		return env.yaml(name), "k8s:enc:kms:v2:" + name + ":"
	})
	if err != nil {
		return nil, err
	}

	var upstream []float64
	if upstreamSamples > 0 {
		upstream, err = upstreamReload(dir, upstreamSamples, s)
		if err != nil {
			return nil, err
		}
	}
	row := func(name, x string, ours []float64, limit float64) Row {
		r := Row{Scenario: "reload", Case: name, Plots: []Plot{headlinePlot(x)}, Figures: []Figure{
			wholeRunFigure("rekey", "ms", summarize(ours), false),
		}}
		up := wholeRunFigure("upstream (1 min poll)", "ms", Stats{}, false)
		if len(upstream) > 0 {
			up.Stats = summarize(upstream)
		} else {
			up.Note = "not run in short mode (polls every 60 s: ~30 s mean)"
		}
		r.Figures = append(r.Figures, up)
		p99 := percentile(ours, 99)
		r.Checks = []Check{{Desc: fmt.Sprintf("p99 < %.0f ms", limit), Met: p99 < limit,
			Got: fmt.Sprintf("p50 %.1f ms, p99 %.1f ms over %d samples", percentile(ours, 50), p99, len(ours))}}
		return r
	}
	rows := []Row{
		row("rename → first write with a new aesgcm key", "reload:\nnew aesgcm key", local, 50),
		row("rename → first write with a new KMS v2 provider (unix socket)", "reload: new\nKMS v2 provider", kms, 100),
	}
	if s.Progress != nil {
		fmt.Fprintf(s.Progress, "reload: local p50 %.1f ms p99 %.1f ms; kms p50 %.1f ms p99 %.1f ms; upstream %v ms\n",
			percentile(local, 50), percentile(local, 99), percentile(kms, 50), percentile(kms, 99), upstream)
	}
	return rows, nil
}

// upstreamReload runs upstream's reload controller with its defaults and renames new
// configs at random points of its poll cycle.
func upstreamReload(dir string, samples int, s Settings) ([]float64, error) {
	path := filepath.Join(dir, "upstream.yaml")
	if err := writeRename(path, aesgcmConfig("u0")); err != nil {
		return nil, err
	}
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	// The first transformers get their own context: the controller cancels it when it
	// replaces them, which must not stop the controller itself.
	loadCtx, closeFirst := context.WithCancel(ctx)
	loaded, err := encryptionconfig.LoadEncryptionConfig(loadCtx, path, true, "bench")
	if err != nil {
		closeFirst()
		return nil, err
	}
	dyn := encryptionconfig.NewDynamicTransformers(loaded.Transformers, loaded.HealthChecks[0], closeFirst, loaded.KMSCloseGracePeriod)
	ctrl := controller.NewDynamicEncryptionConfiguration("bench", path, dyn, loaded.EncryptionFileContentHash, "bench")
	go ctrl.Run(ctx)
	tr := dyn.TransformerForResource(secretsGR)
	var ms []float64
	for i := 1; i <= samples; i++ {
		// A random offset into the 1-minute cycle, so samples are not phase-locked.
		time.Sleep(rand.N(controller.EncryptionConfigFileChangePollDuration))
		name := fmt.Sprintf("u%d", i)
		start := time.Now()
		if err := writeRename(path, aesgcmConfig(name)); err != nil {
			return nil, err
		}
		d, err := waitForPrefix(tr, "k8s:enc:aesgcm:v1:"+name+":", start, 3*time.Minute)
		if err != nil {
			return nil, err
		}
		ms = append(ms, float64(d.Microseconds())/1000)
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "reload: upstream sample %d/%d: %.1f s\n", i, samples, ms[len(ms)-1]/1000)
		}
	}
	return ms, nil
}
