package bench

import (
	"context"
	"fmt"
	"io"
	"strings"
	"time"

	"k8s.io/apimachinery/pkg/api/meta"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/types"

	"github.com/rekey-io/rekey/api/v1alpha1"
	"github.com/rekey-io/rekey/internal/testbed"
)

// The controller scenario's two procedures: rekey's (a rotationGeneration raised on a
// ControlPlaneEncryption, `rekey controller` doing the rest) and a Gardener-style one
// (the same Secret edits, a rolling restart after each, a rewrite of every object).

// cpeName is the object of rekey's side.
const cpeName = "tenant"

// startRekeyController creates the object for the bed's control plane (its Secret,
// its etcd) and starts `rekey controller`, returning once the controller leads and
// watches the objects (its log says "watching"; it writes no status for an object
// with nothing to do).
func startRekeyController(ctx context.Context, progress io.Writer, dir string, mgmt *mgmtAPI, rekeyBin string, b *hostedBed, secret string) (*testbed.Process, error) {
	o := &v1alpha1.ControlPlaneEncryption{
		ObjectMeta: metav1.ObjectMeta{Name: cpeName, Namespace: mgmtNamespace},
		Spec: v1alpha1.ControlPlaneEncryptionSpec{
			ConfigSecretRef: v1alpha1.SecretKeyRef{Name: secret, Key: mgmtConfigKey},
			Etcd:            v1alpha1.EtcdAccess{Endpoints: b.etcd.Endpoints(), EtcdPrefix: rotationPrefix},
			Timeout:         &metav1.Duration{Duration: rotationTimeout},
		},
	}
	if err := mgmt.createCPE(ctx, o); err != nil {
		return nil, err
	}
	start := time.Now()
	p, err := startController(dir, rekeyBin, mgmt.server.Kubeconfig)
	if err != nil {
		return nil, err
	}
	for !strings.Contains(p.Log(1<<20), `"watching"`) {
		select {
		case <-p.Done():
			return nil, fmt.Errorf("rekey controller exited: %v\n%s", p.ExitErr(), p.Log(4000))
		case <-ctx.Done():
			p.Stop(10 * time.Second)
			return nil, ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
		if time.Since(start) > time.Minute {
			p.Stop(10 * time.Second)
			return nil, fmt.Errorf("rekey controller does not watch the objects after a minute\n%s", p.Log(4000))
		}
	}
	fmt.Fprintf(progress, "controller: rekey: the controller leads and watches %v after its start\n", time.Since(start).Round(time.Millisecond))
	return p, nil
}

// rotateByController raises rotationGeneration to 1 (start is just before) and polls
// the object until its condition says Completed; it returns that moment, the Secret's
// final configuration and each stage's first sight.
func rotateByController(ctx context.Context, progress io.Writer, mgmt *mgmtAPI, b *hostedBed, start time.Time) (time.Time, []byte, []controllerStep, error) {
	if _, err := mgmt.cpes.Patch(ctx, cpeName, types.MergePatchType, []byte(`{"spec":{"rotationGeneration":1}}`), metav1.PatchOptions{}); err != nil {
		return time.Time{}, nil, nil, err
	}
	var steps []controllerStep
	last := ""
	for {
		o, err := mgmt.getCPE(ctx, cpeName)
		now := time.Now()
		if err == nil {
			st := o.Status
			if cur := fmt.Sprintf("%s/%s", st.Phase, st.Stage); cur != last && st.ObservedRotationGeneration >= 1 {
				last = cur
				steps = append(steps, controllerStep{what: cur, at: now.Sub(start)})
				fmt.Fprintf(progress, "controller: rekey: +%v phase %s, stage %s: %s\n", now.Sub(start).Round(time.Millisecond), st.Phase, st.Stage, st.Message)
			}
			c := meta.FindStatusCondition(st.Conditions, v1alpha1.ConditionEtcdDataEncryptionUpToDate)
			if st.ObservedRotationGeneration >= 1 && st.Phase == v1alpha1.PhaseCompleted && len(st.History) > 0 &&
				c != nil && c.Status == metav1.ConditionTrue && c.Reason == v1alpha1.ReasonCompleted {
				final, err := mgmt.configSecret(ctx, o.Spec.ConfigSecretRef.Name)
				if err != nil {
					return time.Time{}, nil, nil, err
				}
				// Completed claims every apiserver serves the final configuration; the
				// metric each one exposes must agree (it may only lag by its poll).
				if _, err := waitConfigHash(ctx, b.fleet, final, 30*time.Second); err != nil {
					return time.Time{}, nil, nil, fmt.Errorf("the object says Completed, but: %w", err)
				}
				return now, final, steps, nil
			}
			if st.Phase == v1alpha1.PhaseFailed {
				return time.Time{}, nil, nil, fmt.Errorf("the rotation failed: %s", st.Message)
			}
		}
		select {
		case <-ctx.Done():
			return time.Time{}, nil, nil, fmt.Errorf("waiting for Completed (last %s): %w", last, ctx.Err())
		case <-time.After(100 * time.Millisecond):
		}
	}
}

// rotateGardenerStyle edits the Secret in Gardener's phases, each followed (once the
// projector has copied it to every apiserver) by a rolling restart, with every Secret
// rewritten through the API once the new key writes. start is just before the first
// edit. It returns when the last apiserver is ready after the last restart.
func rotateGardenerStyle(ctx context.Context, progress io.Writer, mgmt *mgmtAPI, b *hostedBed, follow *testbed.SourceFollower, secret string, start time.Time) (done time.Time, final []byte, r gardenerRun, err error) {
	key1, key2 := b.oldKey, testbed.NamedKey{Name: "key2", Secret: testbed.RandomKey()}
	step := func(what string) {
		at := time.Since(start)
		if n := len(r.steps); n > 0 {
			fmt.Fprintf(progress, "controller: gardener: +%v %s (%v)\n", at.Round(time.Millisecond), what, (at - r.steps[n-1].at).Round(time.Millisecond))
		} else {
			fmt.Fprintf(progress, "controller: gardener: +%v %s\n", at.Round(time.Millisecond), what)
		}
		r.steps = append(r.steps, controllerStep{what: what, at: at})
	}
	phase := func(name string, cfg testbed.EncryptionConfig) error {
		before := len(follow.Rounds())
		if err := mgmt.editConfigSecret(ctx, secret, cfg.Render()); err != nil {
			return fmt.Errorf("%s: %w", name, err)
		}
		// The projector picks the edit up within its poll and copies it after each
		// apiserver's delay.
		for len(follow.Rounds()) == before {
			select {
			case <-ctx.Done():
				return fmt.Errorf("%s: the projector did not see the edit: %w", name, ctx.Err())
			case <-time.After(20 * time.Millisecond):
			}
		}
		if _, err := follow.Rounds()[before].Round.Wait(ctx); err != nil {
			return fmt.Errorf("%s: projecting: %w", name, err)
		}
		step(name + ": projected")
		n, out, err := rollingRestart(ctx, b.fleet)
		r.restarts += n
		r.outOfLB += out
		if err != nil {
			return fmt.Errorf("%s: rolling restart: %w", name, err)
		}
		step(name + ": rolling restart")
		return nil
	}
	if err := phase("key2 added for reads", testbed.SecretsConfig(testbed.AESGCM(key1, key2))); err != nil {
		return time.Time{}, nil, r, err
	}
	if err := phase("key2 the write key", testbed.SecretsConfig(testbed.AESGCM(key2, key1))); err != nil {
		return time.Time{}, nil, r, err
	}
	n, conflicts, err := rewriteSecrets(ctx, b.fleet)
	r.rewrite = rewriteTally{rewritten: n, conflicts: conflicts}
	if err != nil {
		return time.Time{}, nil, r, err
	}
	step(fmt.Sprintf("%d Secrets rewritten (%d conflicts retried)", n, conflicts))
	last := testbed.SecretsConfig(testbed.AESGCM(key2))
	if err := phase("key1 dropped", last); err != nil {
		return time.Time{}, nil, r, err
	}
	return time.Now(), last.Render(), r, nil
}

// gardenerRun is what the Gardener-style procedure did besides its end.
type gardenerRun struct {
	steps    []controllerStep
	restarts int
	// outOfLB is how long apiservers were out of the load balancer, summed.
	outOfLB time.Duration
	rewrite rewriteTally
}

// rollingRestart restarts every shim of the fleet, one at a time, as a Deployment's
// rolling update with maxUnavailable 1 does: out of the load balancer, SIGTERM (its
// graceful shutdown drains what is in flight), started again on the same directory
// (it reads its file as it is now), ready, back in. It returns the restarts and how
// long the apiservers were out of the load balancer, summed.
func rollingRestart(ctx context.Context, f *testbed.Fleet) (n int, out time.Duration, err error) {
	for _, s := range f.Shims {
		stopped := time.Now()
		s.Stop(30 * time.Second)
		if err := s.Launch(ctx); err != nil {
			return n, out + time.Since(stopped), fmt.Errorf("%s: %w", s.ID, err)
		}
		n++
		wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
		err := s.WaitReady(wctx)
		cancel()
		out += time.Since(stopped)
		if err != nil {
			return n, out, fmt.Errorf("%s after its restart: %w", s.ID, err)
		}
	}
	return n, out, nil
}
