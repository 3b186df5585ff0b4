package bench

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
)

// The scale scenario's upstream side: upstream's documented rotation of a local key on
// one apiserver, with `kubectl get secrets -A -o json | kubectl replace -f -` as the
// rewrite.

// scaleListPage is kubectl get's --chunk-size default.
const scaleListPage = 500

// rotateUpstreamAtScale adds key2 for reads, promotes it (each step waits until the
// shim reports the new config's hash: upstream's layer polls its file every minute),
// then replaces every Secret; it returns the first edit, the start and the end of the
// replace. A replace that does not finish within limit stops there: res.extrapolated
// is set and res.rewritten says how far it got.
func rotateUpstreamAtScale(ctx context.Context, logf func(string, ...any), b *scaleBed, key2 testbed.NamedKey, limit time.Duration, res *scaleResult) (firstEdit, start, end time.Time, err error) {
	path := b.fleet.Shims[0].ConfigPath
	step := func(what string, cfg testbed.EncryptionConfig) error {
		content := cfg.Render()
		at := time.Now()
		if firstEdit.IsZero() {
			firstEdit = at
		}
		if err := testbed.WriteFileAtomic(path, content); err != nil {
			return err
		}
		seen, err := waitConfigHash(ctx, b.fleet, content, 3*time.Minute)
		if err != nil {
			return fmt.Errorf("%s: %w", what, err)
		}
		logf("%s: the apiserver reports the new hash after %v", what, seen.Sub(at).Round(time.Millisecond))
		return nil
	}
	if err := step("key2 added as a read key", testbed.SecretsConfig(testbed.AESGCM(b.key1, key2))); err != nil {
		return firstEdit, start, end, err
	}
	if err := step("key2 promoted to write key", testbed.SecretsConfig(testbed.AESGCM(key2, b.key1))); err != nil {
		return firstEdit, start, end, err
	}
	start = time.Now()
	rctx, cancel := context.WithTimeout(ctx, limit)
	defer cancel()
	done, conflicts, err := replaceAllSecrets(rctx, b)
	end = time.Now()
	res.rewritten, res.conflicts = done, conflicts
	if err != nil && rctx.Err() != nil && ctx.Err() == nil {
		res.extrapolated = true
		logf("the replace hit its %v limit after %d Secrets", limit, done)
		return firstEdit, start, end, nil
	}
	if err != nil {
		return firstEdit, start, end, err
	}
	logf("%d Secrets replaced in %v, %d conflicts retried", done, end.Sub(start).Round(time.Millisecond), conflicts)
	return firstEdit, start, end, nil
}

// replaceAllSecrets does what `kubectl get secrets -A -o json | kubectl replace -f -`
// does: list every Secret in pages of scaleListPage, then PUT each one back as listed;
// a conflict (the client workload updated it since) re-reads and retries. kubectl
// replace sends one request at a time and kubectl get holds the whole list in memory
// first; this streams page by page and keeps rewriteWorkers requests in flight, as an
// operator's `xargs -P 8` would, so it is the faster variant of the procedure. A list
// that outlives etcd's compaction (5 minutes) has its continue token refused; the
// apiserver then offers one that continues from the same key at the latest revision,
// and this takes it (a replace of an object changed since is a conflict, re-read and
// retried), where kubectl get would have held every page in memory already.
func replaceAllSecrets(ctx context.Context, b *scaleBed) (done, conflicts int64, err error) {
	c, err := b.fleet.Shims[0].Client()
	if err != nil {
		return 0, 0, err
	}
	items := make(chan corev1.Secret, scaleListPage)
	var nDone, nConf atomic.Int64
	errs := make([]error, rewriteWorkers+1)
	var wg sync.WaitGroup
	wctx, stop := context.WithCancel(ctx)
	defer stop()
	for w := range rewriteWorkers {
		wg.Go(func() {
			for s := range items {
				secrets := c.CoreV1().Secrets(s.Namespace)
				_, err := secrets.Update(wctx, &s, metav1.UpdateOptions{})
				if apierrors.IsConflict(err) {
					var n int64
					n, err = noopUpdate(wctx, secrets, s.Name)
					nConf.Add(n + 1)
				}
				if apierrors.IsNotFound(err) {
					err = nil // deleted since the list
				}
				if err != nil {
					errs[w] = fmt.Errorf("replacing %s/%s: %w", s.Namespace, s.Name, err)
					stop()
					return
				}
				nDone.Add(1)
			}
		})
	}
	opts := metav1.ListOptions{Limit: scaleListPage}
list:
	for {
		l, err := c.CoreV1().Secrets(metav1.NamespaceAll).List(wctx, opts)
		var st apierrors.APIStatus
		if apierrors.IsResourceExpired(err) && errors.As(err, &st) && st.Status().ListMeta.Continue != "" {
			opts.Continue = st.Status().ListMeta.Continue
			continue
		}
		if err != nil {
			errs[rewriteWorkers] = fmt.Errorf("listing Secrets: %w", err)
			break
		}
		for _, s := range l.Items {
			select {
			case items <- s:
			case <-wctx.Done():
				break list
			}
		}
		if l.Continue == "" {
			break
		}
		opts.Continue = l.Continue
	}
	close(items)
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		return nDone.Load(), nConf.Load(), err
	}
	return nDone.Load(), nConf.Load(), wctx.Err()
}
