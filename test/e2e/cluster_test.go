package e2e

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
)

// clusterDoc is the part of the status document the cluster test reads.
type clusterDoc struct {
	Cluster *cluster.Status `json:"cluster"`
}

// Two shim processes on one etcd, each with its own config file. One edit "new key
// first, old key second" reaches shim a first: a holds the new key (its stored data and
// new writes stay on the old key) until shim b's file can read it, then both promote and
// the elected leader migrates everything to the new key once. The old key can then be
// dropped.
func TestTwoShimsOneEditFence(t *testing.T) {
	ctx := t.Context()
	dir := t.TempDir()
	const prefix = "/e2e-cluster"
	const k1, k2 = "k8s:enc:aesgcm:v1:key1:", "k8s:enc:aesgcm:v1:key2:"
	key1, key2 := testbed.RandomKey(), testbed.RandomKey()
	old := encryptionConfig([]string{aesgcm("key1", key1)}, []string{aesgcm("key1", key1)})
	both := encryptionConfig([]string{aesgcm("key2", key2), aesgcm("key1", key1)}, []string{aesgcm("key2", key2), aesgcm("key1", key1)})
	coord := []string{"--coordination-prefix", "/rekey-e2e-cluster", "--cluster-lease-ttl", "30s", "--storage-migration-check-interval", "250ms"} // long leases: a lapse on a loaded machine would end the hold this test checks
	var shims []*testbed.Shim
	var paths []string
	for _, id := range []string{"a", "b"} {
		sub := filepath.Join(dir, id)
		if err := os.MkdirAll(sub, 0o700); err != nil {
			t.Fatal(err)
		}
		p := filepath.Join(sub, "encryption.yaml")
		writeConfig(t, p, old)
		shims = append(shims, startShim(t, testbed.ShimConfig{Name: "shim-" + id, Dir: sub, EncryptionConfig: p, EtcdPrefix: prefix,
			Args: append([]string{"--apiserver-id", id}, coord...)}))
		paths = append(paths, p)
	}
	a, b := shims[0], shims[1]
	names := createObjects(t, clientFor(t, a), "cluster", 50)
	eventually(t, 30*time.Second, 100*time.Millisecond, "two converged members", func() error {
		d, body := statusDoc[clusterDoc](t, a)
		if d.Cluster == nil || len(d.Cluster.Members) != 2 || !d.Cluster.Verdict.Converged {
			return fmt.Errorf("cluster section: %.400s", body)
		}
		return nil
	})

	writeConfig(t, paths[0], both)
	eventually(t, 20*time.Second, 100*time.Millisecond, "a holding key2 for b", func() error {
		d, _ := statusDoc[clusterDoc](t, a)
		if len(d.Cluster.Holds) != 2 || strings.Join(d.Cluster.Holds[0].WaitingFor, ",") != "b" {
			return fmt.Errorf("holds %+v", d.Cluster.Holds)
		}
		return nil
	})
	// While a holds key2, writes through a stay on key1 and nothing is migrated.
	c := clientFor(t, a)
	if _, err := c.CoreV1().Secrets("cluster").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "during-hold"},
		StringData: map[string]string{"v": "held"}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	time.Sleep(time.Second)
	if got := rawPrefixes(t, ctx, prefix+"/"); got[k2] != 0 {
		t.Fatalf("objects on key2 while b cannot read it: %v", got)
	}

	writeConfig(t, paths[1], both)
	eventually(t, 60*time.Second, 200*time.Millisecond, "every object on key2, converged", func() error {
		got := rawPrefixes(t, ctx, prefix+"/")
		if got[k1] != 0 || got[k2] != len(names)+1 {
			return fmt.Errorf("stored: %v", got)
		}
		d, body := statusDoc[clusterDoc](t, b)
		if d.Cluster == nil || !d.Cluster.Verdict.Converged {
			return fmt.Errorf("cluster section: %.600s", body)
		}
		return nil
	})

	// Both objects written before and during the hold read back through b.
	if _, err := clientFor(t, b).CoreV1().Secrets("cluster").Get(ctx, "during-hold", metav1.GetOptions{}); err != nil {
		t.Fatal(err)
	}
	// key1 can go now, on both.
	only2 := encryptionConfig([]string{aesgcm("key2", key2)}, []string{aesgcm("key2", key2)})
	for i, s := range shims {
		writeConfig(t, paths[i], only2)
		eventually(t, 30*time.Second, 200*time.Millisecond, s.Name+" dropping key1", func() error {
			d, _ := getStorageDoc(t, s)
			if d.ActiveConfigHash != config.Hash([]byte(only2)) {
				return fmt.Errorf("active %s, last error %q", d.ActiveConfigHash, d.LastError)
			}
			return nil
		})
	}
}
