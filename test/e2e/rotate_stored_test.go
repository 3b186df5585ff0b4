package e2e

// `rekey rotate --wait` on rules with identity behind the write key, the shape
// upstream's documentation shows: identity is the fallback for values written before
// encryption, not an old key, and whether a rotation is in progress comes from what is
// stored.

import (
	"context"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/testbed"
)

// TestRotateWaitKeepsIdentity: [aesgcm key1, identity] with every Secret under key1
// is a new rotation, not a first-time encryption in progress: rotate --wait adds a key
// and ends with [<new>, identity], every stored Secret under the new key, while writers
// and a sampler run on three shims.
func TestRotateWaitKeepsIdentity(t *testing.T) {
	requireClusterShim(t)
	bin := rekeyBin(t)
	b := newClusterBed(t, bedConfig{name: "rotate-identity", objects: envInt("ROTATE_WAIT_OBJECTS", 300), coordination: true,
		minDelay: 500 * time.Millisecond, maxDelay: 4 * time.Second,
		initial: func(b *clusterBed, _ int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.AESGCM(b.key1), testbed.Identity())
		}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	source, follow := followedSource(ctx, t, b, testbed.SecretsConfig(testbed.AESGCM(b.key1), testbed.Identity()).Render())
	defer follow.Stop()
	defer cancel()
	l := b.startLoad()

	out, err := runRotateWait(ctx, t, bin, rotateWaitArgs(b, source))
	if err != nil {
		t.Fatalf("rekey rotate --wait: %v", err)
	}
	for _, want := range []string{"starting a new rotation", "identity stays behind", `removed the read key "key1"`, "stage 4/4 ack",
		"identity stays behind it as the fallback"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if strings.Contains(out, "resuming") {
		t.Errorf("rotate --wait read [key1, identity] with nothing stale as a rotation in progress")
	}
	keys := sourceKeys(t, source)
	if len(keys) != 1 || !strings.HasPrefix(keys[0], "key-") {
		t.Fatalf("keys in the source file after rotate --wait: %v, want only the new key", keys)
	}
	data, err := os.ReadFile(source)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(data), "identity: {}") {
		t.Fatalf("identity is gone from the source file:\n%s", data)
	}
	if err := testbed.AllStoredUnder(ctx, b.cli, b.secretsKey, "k8s:enc:aesgcm:v1:"+keys[0]+":"); err != nil {
		t.Fatal(err)
	}
	noSecretsIn(t, "rotate --wait", out, append(fileSecrets(t, source), b.key1.Secret))
	b.finishFollowing(ctx, cancel, follow, l)
}

// TestRotateWaitKMSKeyIDKeepsIdentity: [kms v2 provider, identity] whose plugin
// rotates its key id (kek-1 → kek-2). The shims ask their plugin's Status every 10 s, so
// rotate --wait, started right after the keyring changed, sees the Secrets under kek-1
// as stale before any shim writes under kek-2: it follows that rotation, without
// editing the file, and ends with every Secret under kek-2 and identity kept.
func TestRotateWaitKMSKeyIDKeepsIdentity(t *testing.T) {
	requireClusterShim(t)
	bin := rekeyBin(t)
	// One plugin for the three shims: their copies of the file must be byte for byte
	// the source (stage 4 compares hashes), so they name the same socket.
	b := newClusterBed(t, bedConfig{name: "rotate-kms-identity", objects: 100, coordination: true, plugins: true, shims: 3,
		minDelay: 500 * time.Millisecond, maxDelay: 2 * time.Second, args: []string{"--kms-status-interval", "10s"},
		initial: func(b *clusterBed, _ int) testbed.EncryptionConfig {
			return testbed.SecretsConfig(testbed.KMSv2("kms-a", b.plugins[0].Endpoint), testbed.Identity())
		}})
	ctx, cancel := context.WithCancel(t.Context())
	defer cancel()
	initial := testbed.SecretsConfig(testbed.KMSv2("kms-a", b.plugins[0].Endpoint), testbed.Identity()).Render()
	source, follow := followedSource(ctx, t, b, initial)
	defer follow.Stop()
	defer cancel()
	if err := testbed.WaitFor(ctx, 100*time.Millisecond, testbed.StoredKeyIDProbe(b.cli, b.secretsKey, "kms-a", "kek-1")); err != nil {
		t.Fatal(err)
	}

	kek2 := testbed.PluginKey{Name: "kek-2", Secret: testbed.RandomKey()}
	if err := testbed.WritePluginKeys(b.plugins[0].KeysFile, kek2, b.kek1); err != nil {
		t.Fatal(err)
	}
	out, err := runRotateWait(ctx, t, bin, rotateWaitArgs(b, source))
	if err != nil {
		t.Fatalf("rekey rotate --wait: %v", err)
	}
	for _, want := range []string{"resuming the rotation in progress: the inventory counts", "stage 2/4 migrate", "stage 4/4 ack",
		"identity stays behind it as the fallback"} {
		if !strings.Contains(out, want) {
			t.Errorf("output lacks %q", want)
		}
	}
	if data, err := os.ReadFile(source); err != nil || string(data) != string(initial) {
		t.Fatalf("the source file changed (%v): a KMS key id rotation needs no edit:\n%s", err, data)
	}
	got, err := testbed.StoredKMSKeyIDs(ctx, b.cli, b.secretsKey)
	if err != nil {
		t.Fatal(err)
	}
	if want := "k8s:enc:kms:v2:kms-a:kek-2"; len(got) != 1 || got[want] == 0 {
		t.Fatalf("stored after rotate --wait: %v, want every Secret under %s", got, want)
	}
	noSecretsIn(t, "rotate --wait", out, []string{b.kek1.Secret, kek2.Secret})
}
