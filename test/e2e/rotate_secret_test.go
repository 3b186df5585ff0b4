package e2e

// The configuration kept in a Secret, as hosted control planes keep it: a management
// API holds it, a kubelet-like projector copies it into each apiserver's file.

import (
	"context"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	corev1client "k8s.io/client-go/kubernetes/typed/core/v1"

	"github.com/rekey-io/rekey/internal/shimtest"
	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/config"
)

// TestRotateWaitFromASecret: `rekey rotate --wait --secret` rotates a configuration
// kept in a Secret of a management API (the shim, in the test's process) that a
// projector copies into each of three apiservers' files, with writers and the sampler
// running. One apiserver's copy is stuck (a subPath mount never updates): the rotation
// never promotes past it and, at its timeout, names it and says why; once its copy is
// fixed the rotation, run again, resumes and finishes. No apiserver restarts, nothing
// fails, nothing is unreadable.
func TestRotateWaitFromASecret(t *testing.T) {
	requireClusterShim(t)
	bin := rekeyBin(t)
	b := newClusterBed(t, bedConfig{name: "rotate-secret", objects: 200, coordination: true,
		minDelay: 200 * time.Millisecond, maxDelay: 1500 * time.Millisecond})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	api := shimtest.Start(t)
	initial := testbed.SecretsConfig(testbed.AESGCM(b.key1)).Render()
	secrets := api.Client.CoreV1()
	if _, err := secrets.Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "kas-encryption"},
		Data: map[string][]byte{"config.yaml": initial}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	follow := testbed.FollowSecret(ctx, secrets, "default", "kas-encryption", "config.yaml", initial, b.syncer)
	defer follow.Stop()
	const stuck = 2
	follow.Stick(stuck)
	stuckID := b.fleet.Shims[stuck].ID
	l := b.startLoad()
	args := []string{"rotate", "--wait", "--secret", "default/kas-encryption:config.yaml", "--kubeconfig", api.Kubeconfig,
		"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--etcd-prefix", b.prefix,
		"--coordination-prefix", b.coord, "--progress", "plain"}

	out, err := runRotateWait(ctx, t, bin, append(args, "--wait-timeout", "12s"))
	if err == nil {
		t.Fatal("rotate --wait finished with one apiserver's copy of the Secret stuck")
	}
	if !strings.Contains(out, "stage 1/4") || !strings.Contains(out, stuckID) || !strings.Contains(out, "does not have the new key yet") {
		t.Fatalf("the timed-out rotation does not name %s as the apiserver whose file lacks the new key", stuckID)
	}
	keys := secretKeys(ctx, t, api.Client.CoreV1(), "kas-encryption")
	if len(keys) != 2 || keys[1] != "key1" {
		t.Fatalf("keys in the Secret after the first edit: %v, want [<new> key1]", keys)
	}

	follow.Unstick(stuck)
	out, err = runRotateWait(ctx, t, bin, append(args, "--wait-timeout", "3m"))
	if err != nil {
		t.Fatalf("rotate --wait after the stuck copy was fixed: %v", err)
	}
	if !strings.Contains(out, "resuming the rotation in progress") {
		t.Errorf("the second run does not say it resumes")
	}
	if got := secretKeys(ctx, t, api.Client.CoreV1(), "kas-encryption"); len(got) != 1 || got[0] != keys[0] {
		t.Fatalf("keys in the Secret after rotate --wait: %v, want only %s (no second new key)", got, keys[0])
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+keys[0]+":"); err != nil {
		t.Fatal(err)
	}
	b.finishFollowing(ctx, cancel, follow, l)
}

// secretKeys reads the aesgcm key names of the configuration in the config.yaml key of
// Secret default/name (never secrets), checking that it is a valid configuration.
func secretKeys(ctx context.Context, t *testing.T, secrets corev1client.SecretsGetter, name string) []string {
	t.Helper()
	sec, err := secrets.Secrets("default").Get(ctx, name, metav1.GetOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := config.Parse(sec.Data["config.yaml"], "the Secret", config.Options{Reload: true}); err != nil {
		t.Fatalf("the Secret holds no valid configuration: %v", err)
	}
	names, err := testbed.AESGCMKeyNames(sec.Data["config.yaml"])
	if err != nil {
		t.Fatal(err)
	}
	return names
}
