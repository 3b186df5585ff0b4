package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The rotation scenario's upstream side: upstream's documented procedure, scripted as an
// operator would run it with kubectl.

// rewriteTally counts the upstream script's no-op updates of every Secret.
type rewriteTally struct{ rewritten, conflicts int64 }

// rotateUpstream follows upstream's documented rotation of a local key, scripted, and
// returns when every apiserver reports the final config's hash.
func rotateUpstream(ctx context.Context, progress io.Writer, b *rotationBed, source string, key1 testbed.NamedKey) (time.Time, []byte, rewriteTally, error) {
	key2 := testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
	step := func(what string, cfg testbed.EncryptionConfig) (time.Time, error) {
		content := cfg.Render()
		start := time.Now()
		if err := testbed.WriteFileAtomic(source, content); err != nil {
			return time.Time{}, err
		}
		at, err := waitConfigHash(ctx, b.fleet, content, rotationTimeout)
		if err != nil {
			return time.Time{}, fmt.Errorf("%s: %w", what, err)
		}
		fmt.Fprintf(progress, "rotation: upstream: %s: every apiserver reports the new hash after %v\n", what, at.Sub(start).Round(time.Millisecond))
		return at, nil
	}
	if _, err := step("key2 added as a read key", testbed.SecretsConfig(testbed.AESGCM(key1, key2))); err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	promoted := testbed.SecretsConfig(testbed.AESGCM(key2, key1))
	if _, err := step("key2 promoted to write key", promoted); err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	start := time.Now()
	n, conflicts, err := rewriteSecrets(ctx, b.fleet)
	if err != nil {
		return time.Time{}, nil, rewriteTally{}, err
	}
	fmt.Fprintf(progress, "rotation: upstream: %d Secrets rewritten (no-op updates, %d workers) in %v, %d conflicts retried\n",
		n, rewriteWorkers, time.Since(start).Round(time.Millisecond), conflicts)
	final := testbed.SecretsConfig(testbed.AESGCM(key2))
	done, err := step("key1 removed", final)
	return done, final.Render(), rewriteTally{rewritten: n, conflicts: conflicts}, err
}

// rewriteSecrets does what `kubectl get secrets -A -o json | kubectl replace -f -`
// does, with rewriteWorkers requests in flight spread over the apiservers as a load
// balancer would: it lists every Secret, then reads and writes back each one
// unchanged, re-reading after a conflict (a writer got there first). An unchanged
// update is stored again because its stored value was read with a key that no longer
// writes.
func rewriteSecrets(ctx context.Context, fleet *testbed.Fleet) (rewritten, conflicts int64, err error) {
	eps := fleet.Endpoints()
	clients := make([]kubernetes.Interface, len(eps))
	for i, ep := range eps {
		if clients[i], err = ep.Client(); err != nil {
			return 0, 0, err
		}
	}
	type ref struct{ ns, name string }
	var all []ref
	opts := metav1.ListOptions{Limit: 500}
	for {
		l, err := clients[0].CoreV1().Secrets(metav1.NamespaceAll).List(ctx, opts)
		if err != nil {
			return 0, 0, fmt.Errorf("listing Secrets: %w", err)
		}
		for _, s := range l.Items {
			all = append(all, ref{s.Namespace, s.Name})
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	var next, done, conf atomic.Int64
	errs := make([]error, rewriteWorkers)
	var wg sync.WaitGroup
	for w := range rewriteWorkers {
		wg.Go(func() {
			for {
				i := int(next.Add(1)) - 1
				if i >= len(all) || ctx.Err() != nil {
					return
				}
				secrets := clients[i%len(clients)].CoreV1().Secrets(all[i].ns)
				c, err := noopUpdate(ctx, secrets, all[i].name)
				conf.Add(c)
				if err != nil {
					errs[w] = fmt.Errorf("rewriting %s/%s: %w", all[i].ns, all[i].name, err)
					return
				}
				done.Add(1)
			}
		})
	}
	wg.Wait()
	return done.Load(), conf.Load(), errors.Join(errs...)
}
