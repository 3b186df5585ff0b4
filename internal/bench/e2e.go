package bench

import (
	"fmt"
	"path/filepath"
	"strings"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// runE2E starts the apiserver shim twice on embedded etcd — once with rekey's layer,
// once with upstream's encryptionconfig layer (--encryption-layer=upstream) — both
// encrypting Secrets with KMS v2 through one local plugin process, and drives
// create+get pairs through client-go, alternating rounds.
func runE2E(s Settings) ([]Row, error) {
	b, err := startBed(s, "rke", "e2e: building the shim, etcd and plugin binaries", bedOptions{plugin: true})
	if err != nil {
		return nil, err
	}
	defer b.close()
	ctx, dir, bins, configPath := b.ctx, b.dir, b.bins, b.configPath
	layers := []string{"rekey", "upstream"}
	shims := map[string]*testbed.Shim{}
	clients := map[string]*kubernetes.Clientset{}
	for _, layer := range layers {
		sh, err := testbed.StartShim(ctx, bins.Shim, testbed.ShimConfig{Name: "shim-" + layer, Dir: filepath.Join(dir, layer), EncryptionConfig: configPath, Layer: layer})
		if err != nil {
			return nil, err
		}
		defer sh.Stop(10 * time.Second)
		cfg := sh.RESTConfig()
		c, err := kubernetes.NewForConfig(cfg)
		if err != nil {
			return nil, err
		}
		shims[layer], clients[layer] = sh, c
	}
	round, workers := 10*time.Second, 8
	if s.Short {
		round = 3 * time.Second
	}
	type result struct {
		pairsPerSec []float64
		create, get []float64 // latencies in ms, all rounds
		failed      int64
	}
	res := map[string]*result{"rekey": {}, "upstream": {}}
	for r := 0; r < s.Rounds; r++ {
		order := layers
		if r%2 == 1 {
			order = []string{"upstream", "rekey"}
		}
		for _, layer := range order {
			st := loadShim(ctx, clients[layer], fmt.Sprintf("bench-%s-%d", layer, r), workers, round)
			rr := res[layer]
			rr.pairsPerSec = append(rr.pairsPerSec, float64(st.pairs)/round.Seconds())
			rr.create = append(rr.create, st.create...)
			rr.get = append(rr.get, st.get...)
			rr.failed += st.failed
			if s.Progress != nil {
				fmt.Fprintf(s.Progress, "e2e round %d %-8s %6.0f create+get pairs/s, %d failed\n", r, layer, float64(st.pairs)/round.Seconds(), st.failed)
			}
		}
	}
	var rows []Row
	tp := Row{Scenario: "e2e (shim on embedded etcd, Secrets with KMS v2)", Case: fmt.Sprintf("create+get pairs/s, %d client-go workers, %v rounds", workers, round)}
	for _, l := range layers {
		tp.Figures = append(tp.Figures, wholeRunFigure(l, "pairs/s", summarize(res[l].pairsPerSec), true))
	}
	tp.Plots = e2ePlot("create+get\npairs/s")
	tp.Checks = []Check{evaluate(tp, Target{Desc: "at least equal to upstream", Against: 1, MinSpeedup: 1})}
	if f := res["rekey"].failed + res["upstream"].failed; f > 0 {
		tp.Checks = append(tp.Checks, Check{Desc: "no failed requests", Met: false, Got: fmt.Sprintf("%d failed", f)})
	}
	rows = append(rows, tp)
	for _, q := range []struct {
		name string
		p    float64
		pick func(*result) []float64
	}{
		{"create latency p50", 50, func(r *result) []float64 { return r.create }},
		{"create latency p99", 99, func(r *result) []float64 { return r.create }},
		{"get latency p50", 50, func(r *result) []float64 { return r.get }},
		{"get latency p99", 99, func(r *result) []float64 { return r.get }},
	} {
		row := Row{Scenario: tp.Scenario, Case: q.name, Plots: e2ePlot(strings.Replace(q.name, " latency ", " latency\n", 1))}
		for _, l := range layers {
			v := percentile(q.pick(res[l]), q.p)
			row.Figures = append(row.Figures, wholeRunFigure(l, "ms", single(v), false))
		}
		rows = append(rows, row)
	}
	ready := Row{Scenario: tp.Scenario, Case: "start → /readyz (embedded etcd, fresh data dir and cert)", Plots: e2ePlot("start →\n/readyz")}
	rss := Row{Scenario: tp.Scenario, Case: "RSS after the load (shim + embedded etcd)", Plots: e2ePlot("RSS after\nthe load")}
	for _, l := range layers {
		ms := float64(shims[l].Ready.Microseconds()) / 1000
		ready.Figures = append(ready.Figures, wholeRunFigure(l, "ms", single(ms), false))
		b, err := testbed.RSS(shims[l].PID())
		if err != nil {
			return nil, err
		}
		mib := float64(b) / (1 << 20)
		rss.Figures = append(rss.Figures, wholeRunFigure(l, "MiB", single(mib), false))
	}
	ready.Checks = []Check{{Desc: "< 2 s", Met: ready.Figures[0].Stats.Median < 2000, Got: fmt.Sprintf("%.0f ms", ready.Figures[0].Stats.Median)}}
	return append(rows, ready, rss), nil
}

func e2ePlot(x string) []Plot {
	return []Plot{{Chart: "e2e", Title: "apiserver shim with KMS v2 Secrets: rekey's layer vs upstream's", X: x, Series: "same shim, embedded etcd", Against: 1}}
}
