package bench

import (
	"context"
	"strconv"
	"sync"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// loadStats is what a create+get load measured.
type loadStats struct {
	pairs, failed int64
	create, get   []float64
}

// loadShim runs workers goroutines that create a 256-byte Secret and read it back, for d.
func loadShim(ctx context.Context, c *kubernetes.Clientset, ns string, workers int, d time.Duration) loadStats {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	payload := make([]byte, 256)
	for i := range payload {
		payload[i] = byte('a' + i%26)
	}
	var mu sync.Mutex
	var total loadStats
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var st loadStats
			secrets := c.CoreV1().Secrets(ns)
			for i := 0; ctx.Err() == nil; i++ {
				name := "s-" + strconv.Itoa(w) + "-" + strconv.Itoa(i)
				t0 := time.Now()
				_, err := secrets.Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: name}, Data: map[string][]byte{"payload": payload}}, metav1.CreateOptions{})
				t1 := time.Now()
				if err == nil {
					_, err = secrets.Get(ctx, name, metav1.GetOptions{})
				}
				t2 := time.Now()
				switch {
				case ctx.Err() != nil:
				case err != nil:
					st.failed++
				default:
					st.pairs++
					st.create = append(st.create, float64(t1.Sub(t0).Microseconds())/1000)
					st.get = append(st.get, float64(t2.Sub(t1).Microseconds())/1000)
				}
			}
			mu.Lock()
			total.pairs += st.pairs
			total.failed += st.failed
			total.create = append(total.create, st.create...)
			total.get = append(total.get, st.get...)
			mu.Unlock()
		}()
	}
	wg.Wait()
	return total
}
