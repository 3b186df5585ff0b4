package e2e

import (
	"cmp"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// Sustained create+get throughput with Secrets on KMS v2: the same shim binary with
// --encryption-layer=rekey and =upstream, on one etcd process and one plugin, loaded
// one at a time in alternating rounds. Long: runs only with E2E_LONG=1.
//
//	E2E_LONG=1 E2E_ROUNDS=3 E2E_ROUND=10s E2E_WORKERS=8 go test -count=1 -v -run Throughput ./test/e2e
func TestThroughputVsUpstream(t *testing.T) {
	if os.Getenv("E2E_LONG") == "" {
		t.Skip("set E2E_LONG=1 to run the throughput comparison")
	}
	rounds := envInt("E2E_ROUNDS", 3)
	workers := envInt("E2E_WORKERS", 8)
	round, err := time.ParseDuration(envOr("E2E_ROUND", "10s"))
	if err != nil {
		t.Fatal(err)
	}

	dir := t.TempDir()
	plugin := startPlugin(t, dir)
	config := filepath.Join(dir, "encryption.yaml")
	writeConfig(t, config, encryptionConfig([]string{kms("bench", plugin.Endpoint), identity}, []string{identity}))
	shims := map[string]*testbed.Shim{}
	clients := map[string]*kubernetes.Clientset{}
	for _, layer := range []string{"rekey", "upstream"} {
		s := startShim(t, testbed.ShimConfig{Name: "shim-" + layer, Dir: filepath.Join(dir, layer), EncryptionConfig: config, Layer: layer})
		shims[layer], clients[layer] = s, clientFor(t, s)
		t.Logf("%s layer: ready %v after start", layer, s.Ready.Round(time.Millisecond))
	}

	results := map[string][]float64{}
	for r := range rounds {
		order := []string{"rekey", "upstream"}
		if r%2 == 1 {
			order = []string{"upstream", "rekey"}
		}
		for _, layer := range order {
			ops, errs := load(t.Context(), clients[layer], fmt.Sprintf("bench-%s-%d", layer, r), workers, round)
			if errs > 0 {
				t.Errorf("%s round %d: %d failed requests", layer, r, errs)
			}
			perSec := float64(ops) / round.Seconds()
			results[layer] = append(results[layer], perSec)
			t.Logf("round %d %-8s %7.0f create+get pairs/s", r, layer, perSec)
		}
	}
	for _, layer := range []string{"rekey", "upstream"} {
		rss, _ := testbed.RSS(shims[layer].PID())
		t.Logf("%-8s median %7.0f create+get pairs/s over %d×%v rounds, %d workers; RSS after load %.0f MiB",
			layer, median(results[layer]), rounds, round, workers, float64(rss)/(1<<20))
	}
	ours, theirs := median(results["rekey"]), median(results["upstream"])
	t.Logf("rekey/upstream throughput ratio: %.2f", ours/theirs)
	if ours < 0.9*theirs {
		t.Errorf("rekey layer %.0f/s is below upstream %.0f/s", ours, theirs)
	}
}

// load runs workers goroutines that each create a Secret and read it back, for d.
// It returns the completed create+get pairs and the failed requests.
func load(ctx context.Context, c *kubernetes.Clientset, ns string, workers int, d time.Duration) (ops, errs int64) {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	var nOps, nErrs atomic.Int64
	payload := make([]byte, 256)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	var wg sync.WaitGroup
	for w := range workers {
		wg.Go(func() {
			secrets := c.CoreV1().Secrets(ns)
			for i := 0; ctx.Err() == nil; i++ {
				name := "s-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				_, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name},
					Data: map[string][]byte{"payload": payload}}, metav1.CreateOptions{})
				if err == nil {
					_, err = secrets.Get(ctx, name, metav1.GetOptions{})
				}
				switch {
				case ctx.Err() != nil:
				case err != nil:
					nErrs.Add(1)
				default:
					nOps.Add(1)
				}
			}
		})
	}
	wg.Wait()
	return nOps.Load(), nErrs.Load()
}

func median[T cmp.Ordered](xs []T) T {
	if len(xs) == 0 {
		var zero T
		return zero
	}
	s := slices.Clone(xs)
	slices.Sort(s)
	return s[len(s)/2]
}

func envOr(k, def string) string {
	if v := os.Getenv(k); v != "" {
		return v
	}
	return def
}

func envInt(k string, def int) int {
	if n, err := strconv.Atoi(os.Getenv(k)); err == nil && n > 0 {
		return n
	}
	return def
}
