package bench

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// runKubeAPIServer runs bin/kube-apiserver (dist/kube-apiserver) on one etcd process
// with rekey's layer and with upstream's (--encryption-layer=upstream, the same binary
// and flags otherwise), each under its own etcd prefix, both encrypting Secrets with
// KMS v2 through one local plugin: several starts of each for time to ready, then one
// of each under the e2e scenario's create+get load.
func runKubeAPIServer(s Settings) ([]Row, error) {
	if s.Short {
		// Building k8s.io/kubernetes alone takes longer than a short run may.
		if s.Progress != nil {
			fmt.Fprintln(s.Progress, "kube-apiserver: skipped in short mode")
		}
		return nil, nil
	}
	b, err := startBed(s, "rkk", "kube-apiserver: building etcd, the plugin and dist/kube-apiserver (the first build compiles k8s.io/kubernetes)", bedOptions{etcd: true, plugin: true})
	if err != nil {
		return nil, err
	}
	defer b.close()
	ctx, dir, etcd, configPath := b.ctx, b.dir, b.etcd, b.configPath
	kapi, err := testbed.BuildKubeAPIServer(ctx, filepath.Join(dir, "bin"), false)
	if err != nil {
		return nil, err
	}
	start := func(layer, name string) (*testbed.Shim, error) {
		return testbed.StartKubeAPIServer(ctx, kapi.Rekey, testbed.KubeAPIServerConfig{
			Name: name, Dir: filepath.Join(dir, name),
			EtcdServers: []string{etcd.Endpoint}, EtcdPrefix: "/bench-" + name,
			EncryptionConfig: configPath, AutomaticReload: true,
			Args: []string{"--encryption-layer", layer},
		})
	}
	// Time to ready, from several starts in alternating order: one start per layer
	// says little on a shared machine, and the first start after a build also pays for
	// reading the binary from disk.
	ready := map[string][]float64{}
	for i := range readyStarts {
		for _, layer := range alternate([]string{"rekey", "upstream"}, i) {
			sv, err := start(layer, fmt.Sprintf("%s-start-%d", layer, i))
			if err != nil {
				return nil, err
			}
			ready[layer] = append(ready[layer], float64(sv.Ready.Microseconds())/1000)
			sv.Stop(30 * time.Second)
		}
	}
	servers := map[string]*testbed.Shim{}
	for _, layer := range alternate([]string{"rekey", "upstream"}, readyStarts) {
		sv, err := start(layer, layer)
		if err != nil {
			return nil, err
		}
		defer sv.Stop(30 * time.Second)
		servers[layer] = sv
		ready[layer] = append(ready[layer], float64(sv.Ready.Microseconds())/1000)
	}
	return measureKubeAPIServers(ctx, s, servers, ready)
}

// readyStarts is how many extra starts per layer time the start → /readyz path.
const readyStarts = 3

// alternate is order for even i and reversed for odd i.
func alternate(order []string, i int) []string {
	if i%2 == 0 {
		return order
	}
	return []string{order[1], order[0]}
}

// kubeAPIServerRounds is how many alternating rounds each layer gets: at least 10, as
// one round's throughput on this shared 2-core machine moves by ±15% with the other
// processes' load, and the per-round ratio's spread is only meaningful over many pairs.
func kubeAPIServerRounds(s Settings) int { return max(2*s.Rounds, 10) }

// measureKubeAPIServers drives the e2e scenario's load (loadShim) against both servers
// in alternating rounds (A B, B A, …; both started once), after an unrecorded warm-up
// per server: the first writes after start pay for cold caches (the first DEK, the
// watch cache, connection pools), which would otherwise land in whichever layer runs
// round 0. Besides the medians it reports the ratio of each round's pair, whose spread
// says how much of a difference between the medians the machine's noise explains.
func measureKubeAPIServers(ctx context.Context, s Settings, servers map[string]*testbed.Shim, ready map[string][]float64) ([]Row, error) {
	layers := []string{"rekey", "upstream"}
	clients := map[string]*kubernetes.Clientset{}
	for _, l := range layers {
		c, err := kubernetes.NewForConfig(servers[l].RESTConfig())
		if err != nil {
			return nil, err
		}
		clients[l] = c
	}
	// kube-apiserver admits objects only into namespaces that exist.
	namespace := func(l, ns string) (string, error) {
		_, err := clients[l].CoreV1().Namespaces().Create(ctx, &corev1.Namespace{ObjectMeta: metav1.ObjectMeta{Name: ns}}, metav1.CreateOptions{})
		if apierrors.IsAlreadyExists(err) {
			err = nil
		}
		return ns, err
	}
	// Short rounds, many of them: bursts of the other processes' load on a shared
	// machine last seconds, and each burst should fall on both sides of some pair.
	round, workers := 6*time.Second, 8
	for _, l := range layers {
		ns, err := namespace(l, "bench-"+l+"-warmup")
		if err != nil {
			return nil, err
		}
		loadShim(ctx, clients[l], ns, workers, round/5)
	}
	m := &kubeAPIServerLoad{rounds: kubeAPIServerRounds(s), workers: workers, round: round}
	pairs, together, create, get, createAtOnce, getAtOnce := m.series()
	rounds := m.rounds
	for r := 0; r < rounds; r++ {
		// Both layers under load at the same moment, each with its own workers: whatever
		// else the machine does then hits both alike, so this pair's ratio is the
		// steadier one. The servers share the CPUs, so the absolute rates are lower.
		var wg sync.WaitGroup
		var mu sync.Mutex
		for _, l := range layers {
			ns, err := namespace(l, fmt.Sprintf("bench-%s-%d-together", l, r))
			if err != nil {
				return nil, err
			}
			wg.Add(1)
			go func() {
				defer wg.Done()
				st := loadShim(ctx, clients[l], ns, workers, round)
				mu.Lock()
				defer mu.Unlock()
				together[l] = append(together[l], float64(st.pairs)/round.Seconds())
				createAtOnce[l], getAtOnce[l] = append(createAtOnce[l], st.create...), append(getAtOnce[l], st.get...)
				m.failed += st.failed
			}()
		}
		wg.Wait()
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "kube-apiserver round %d together rekey %6.0f upstream %6.0f pairs/s, ratio ×%.2f\n",
				r, together["rekey"][r], together["upstream"][r], together["rekey"][r]/together["upstream"][r])
		}

		for _, l := range alternate(layers, r) {
			ns, err := namespace(l, fmt.Sprintf("bench-%s-%d", l, r))
			if err != nil {
				return nil, err
			}
			st := loadShim(ctx, clients[l], ns, workers, round)
			pairs[l] = append(pairs[l], float64(st.pairs)/round.Seconds())
			create[l], get[l] = append(create[l], st.create...), append(get[l], st.get...)
			m.failed += st.failed
			if s.Progress != nil {
				fmt.Fprintf(s.Progress, "kube-apiserver round %d %-8s %6.0f create+get pairs/s, %d failed\n", r, l, float64(st.pairs)/round.Seconds(), st.failed)
			}
		}
		if s.Progress != nil {
			fmt.Fprintf(s.Progress, "kube-apiserver round %d ratio rekey/upstream ×%.2f\n", r, pairs["rekey"][r]/pairs["upstream"][r])
		}
	}
	return kubeAPIServerRows(m, layers, servers, ready)
}

// kubeAPIServerLoad is what the kube-apiserver scenario's rounds measured, per layer:
// create+get pairs/s in alternating rounds and loaded at once, and the requests'
// latencies in ms.
type kubeAPIServerLoad struct {
	rounds, workers int
	round           time.Duration
	pairs, together map[string][]float64
	create, get     map[string][]float64
	// createAtOnce and getAtOnce are the latencies with both layers loaded at once.
	createAtOnce, getAtOnce map[string][]float64
	failed                  int64
}

// series makes the load's maps and returns them to be filled.
func (m *kubeAPIServerLoad) series() (pairs, together, create, get, createAtOnce, getAtOnce map[string][]float64) {
	m.pairs, m.together = map[string][]float64{}, map[string][]float64{}
	m.create, m.get = map[string][]float64{}, map[string][]float64{}
	m.createAtOnce, m.getAtOnce = map[string][]float64{}, map[string][]float64{}
	return m.pairs, m.together, m.create, m.get, m.createAtOnce, m.getAtOnce
}

// kubeAPIServerRows are the kube-apiserver scenario's rows: m's throughput and
// latencies, the times to ready and the servers' RSS.
func kubeAPIServerRows(m *kubeAPIServerLoad, layers []string, servers map[string]*testbed.Shim, ready map[string][]float64) ([]Row, error) {
	pairs, together, create, get, createAtOnce, getAtOnce := m.pairs, m.together, m.create, m.get, m.createAtOnce, m.getAtOnce
	rounds, workers, round, failed := m.rounds, m.workers, m.round, m.failed
	ratios := roundRatios(pairs["rekey"], pairs["upstream"])
	scenario := "kube-apiserver (bin/kube-apiserver on an etcd process, Secrets with KMS v2)"
	tp := Row{Scenario: scenario, Case: fmt.Sprintf("create+get pairs/s, %d client-go workers, %d alternating rounds of %v", workers, rounds, round),
		Plots: kubeAPIServerPlot("create+get\npairs/s")}
	for _, l := range layers {
		tp.Figures = append(tp.Figures, wholeRunFigure(l, "pairs/s", summarize(pairs[l]), true))
	}
	rs := summarize(ratios)
	tp.Checks = []Check{
		evaluate(tp, Target{Desc: "at least equal to upstream", Against: 1, MinSpeedup: 1}),
		{Desc: "per-round ratio rekey/upstream (each round's pair)", Met: rs.Median >= 1,
			Got: fmt.Sprintf("median ×%.2f, quartiles ×%.2f–×%.2f, range ×%.2f–×%.2f over %d rounds",
				rs.Median, percentile(ratios, 25), percentile(ratios, 75), rs.Min, rs.Max, len(ratios))},
	}
	if failed > 0 {
		tp.Checks = append(tp.Checks, Check{Desc: "no failed requests", Met: false, Got: fmt.Sprintf("%d failed", failed)})
	}
	tg := Row{Scenario: scenario, Case: fmt.Sprintf("create+get pairs/s, both layers loaded at once (%d workers each), %d rounds of %v", workers, rounds, round),
		Plots: kubeAPIServerPlot("create+get pairs/s,\nloaded at once")}
	for _, l := range layers {
		tg.Figures = append(tg.Figures, wholeRunFigure(l, "pairs/s", summarize(together[l]), true))
	}
	tr := roundRatios(together["rekey"], together["upstream"])
	ts := summarize(tr)
	tg.Checks = []Check{{Desc: "per-round ratio rekey/upstream at least 1 (median)", Met: ts.Median >= 1,
		Got: fmt.Sprintf("median ×%.2f, quartiles ×%.2f–×%.2f, range ×%.2f–×%.2f over %d rounds",
			ts.Median, percentile(tr, 25), percentile(tr, 75), ts.Min, ts.Max, len(tr))}}
	rows := []Row{tp, tg}
	for _, q := range []struct {
		name string
		p    float64
		of   map[string][]float64
	}{
		{"create latency p50", 50, create}, {"create latency p99", 99, create},
		{"get latency p50", 50, get}, {"get latency p99", 99, get},
		// Loaded at once, a burst of the machine's other load delays both layers' requests
		// alike; in the alternating rounds it lands on whichever layer runs then.
		{"create latency p99, loaded at once", 99, createAtOnce}, {"get latency p99, loaded at once", 99, getAtOnce},
	} {
		row := Row{Scenario: scenario, Case: q.name}
		if q.p == 99 {
			row.Plots = kubeAPIServerPlot(strings.NewReplacer(" latency ", " latency\n", ", ", ",\n").Replace(q.name))
		}
		for _, l := range layers {
			row.Figures = append(row.Figures, wholeRunFigure(l, "ms", single(percentile(q.of[l], q.p)), false))
		}
		if q.p == 99 {
			row.Checks = []Check{evaluate(row, Target{Desc: "no worse than upstream", Against: 1, MinSpeedup: 1})}
		}
		rows = append(rows, row)
	}
	readyRow := Row{Scenario: scenario, Case: fmt.Sprintf("start → /readyz (fresh etcd prefix and cert, %d starts, alternating order)", len(ready["rekey"])),
		Plots: kubeAPIServerPlot("start →\n/readyz")}
	rss := Row{Scenario: scenario, Case: "RSS after the load (kube-apiserver alone)", Plots: kubeAPIServerPlot("RSS after\nthe load")}
	for _, l := range layers {
		readyRow.Figures = append(readyRow.Figures, wholeRunFigure(l, "ms", summarize(ready[l]), false))
		b, err := testbed.RSS(servers[l].PID())
		if err != nil {
			return nil, err
		}
		rss.Figures = append(rss.Figures, wholeRunFigure(l, "MiB", single(float64(b)/(1<<20)), false))
	}
	return append(rows, readyRow, rss), nil
}

func kubeAPIServerPlot(x string) []Plot {
	return []Plot{{Chart: "kube-apiserver", Title: "kube-apiserver v1.37.2 with KMS v2 Secrets: rekey's layer vs upstream's", X: x,
		Series: "same binary, --encryption-layer", Against: 1}}
}
