package e2e

// `rekey rotate --wait` on the many-apiserver testbed: the operator
// edits one source file; a syncer copies it to each shim's own file after a random
// delay, as kubelets refresh a mounted Secret on every node.

import (
	"bufio"
	"context"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// fileSecrets returns every secret in an encryption config file.
func fileSecrets(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, m := range regexp.MustCompile(`secret: *"?([A-Za-z0-9+/=]{16,})`).FindAllStringSubmatch(string(data), -1) {
		out = append(out, m[1])
	}
	if len(out) == 0 {
		t.Fatalf("no secret found in %s", path)
	}
	return out
}

func noSecretsIn(t *testing.T, what, out string, secrets []string) {
	t.Helper()
	for _, s := range secrets {
		if strings.Contains(out, s) {
			t.Fatalf("%s printed key material", what)
		}
	}
}

// sourceKeys reads the aesgcm key names of the source file (never secrets).
func sourceKeys(t *testing.T, path string) []string {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	names, err := testbed.AESGCMKeyNames(data)
	if err != nil {
		t.Fatal(err)
	}
	return names
}

// followedSource writes initial to a source file that the bed's syncer copies to every
// shim's own file whenever it changes, as kubelets refresh a mounted Secret.
func followedSource(ctx context.Context, t *testing.T, b *clusterBed, initial []byte) (string, *testbed.SourceFollower) {
	t.Helper()
	source := filepath.Join(t.TempDir(), "encryption.yaml")
	if err := os.WriteFile(source, initial, 0o600); err != nil {
		t.Fatal(err)
	}
	return source, testbed.FollowSource(ctx, source, initial, b.syncer)
}

// finishFollowing waits for every sync round of the source file, stops following it
// (cancel ends the follower's context) and finishes the load with the bed's checks.
func (b *clusterBed) finishFollowing(ctx context.Context, cancel context.CancelFunc, follow *testbed.SourceFollower, l *clusterLoad) {
	b.t.Helper()
	for _, r := range follow.Rounds() {
		if _, err := r.Round.Wait(ctx); err != nil {
			b.t.Errorf("syncing the source file: %v", err)
		}
	}
	cancel()
	follow.Stop()
	b.finish(l)
}

// rotateWaitArgs are the arguments of `rekey rotate --wait` on source for the bed.
func rotateWaitArgs(b *clusterBed, source string, extra ...string) []string {
	return append([]string{"rotate", "--encryption-provider-config", source, "--wait",
		"--etcd-servers", strings.Join(b.etcd.Endpoints(), ","), "--etcd-prefix", b.prefix,
		"--coordination-prefix", b.coord, "--wait-timeout", "3m", "--progress", "plain"}, extra...)
}

// runRotateWait runs the built rekey with args and logs its output and duration.
func runRotateWait(ctx context.Context, t *testing.T, bin string, args []string) (string, error) {
	t.Helper()
	start := time.Now()
	out, err := exec.CommandContext(ctx, bin, args...).CombinedOutput()
	t.Logf("rekey rotate --wait (%v):\n%s", time.Since(start).Round(time.Millisecond), out)
	return string(out), err
}

// TestRotateWait runs the built `rekey rotate --wait` against a source file while
// writers and a sampler run on three shims: it exits 0 with only the new key in the
// file and every Secret stored under it, nothing failed and nothing unreadable. Then a
// second rotation is killed right after its first edit, and run again: it finishes that
// rotation without adding another key.
func TestRotateWait(t *testing.T) {
	requireClusterShim(t)
	bin := rekeyBin(t)
	b := newClusterBed(t, bedConfig{name: "rotate-wait", objects: envInt("ROTATE_WAIT_OBJECTS", 300), coordination: true,
		minDelay: 500 * time.Millisecond, maxDelay: 4 * time.Second})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	source, follow := followedSource(ctx, t, b, testbed.SecretsConfig(testbed.AESGCM(b.key1)).Render())
	defer follow.Stop()
	defer cancel()
	l := b.startLoad()
	args := rotateWaitArgs(b, source)

	out, err := runRotateWait(ctx, t, bin, args)
	if err != nil {
		t.Fatalf("rekey rotate --wait: %v", err)
	}
	keys := sourceKeys(t, source)
	if len(keys) != 1 || !strings.HasPrefix(keys[0], "key-") {
		t.Fatalf("keys in the source file after rotate --wait: %v, want only the new key", keys)
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+keys[0]+":"); err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(out, "stage 4/4 ack") {
		t.Fatalf("output lacks the stages")
	}
	// No key material: neither the old key nor the one rotate generated.
	noSecretsIn(t, "rotate --wait", out, append(fileSecrets(t, source), b.key1.Secret))

	// Resume: the first run is killed once it has written its first edit.
	cmd := exec.CommandContext(ctx, bin, args...)
	stdout, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	cmd.Stderr = cmd.Stdout
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	var killed strings.Builder
	sc := bufio.NewScanner(stdout)
	for sc.Scan() {
		killed.WriteString(sc.Text() + "\n")
		if strings.Contains(sc.Text(), "first edit written") {
			_ = cmd.Process.Kill()
			break
		}
	}
	_, _ = io.Copy(io.Discard, stdout)
	_ = cmd.Wait()
	t.Logf("killed rekey rotate --wait after its first edit:\n%s", killed.String())
	mid := sourceKeys(t, source)
	keysSeen := fileSecrets(t, source) // the killed run's new key and the first run's
	if len(mid) != 2 || mid[1] != keys[0] {
		t.Fatalf("keys after the killed run: %v, want [<new> %s]", mid, keys[0])
	}
	out, err = runRotateWait(ctx, t, bin, args)
	if err != nil {
		t.Fatalf("resumed rekey rotate --wait: %v", err)
	}
	if !strings.Contains(out, "resuming the rotation in progress") {
		t.Errorf("the resumed run does not say it resumes")
	}
	noSecretsIn(t, "the resumed rotate --wait", killed.String()+out, append(fileSecrets(t, source), keysSeen...))
	if got := sourceKeys(t, source); len(got) != 1 || got[0] != mid[0] {
		t.Fatalf("keys after the resumed run: %v, want only %s (no second new key)", got, mid[0])
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+mid[0]+":"); err != nil {
		t.Fatal(err)
	}
	b.finishFollowing(ctx, cancel, follow, l)
}
