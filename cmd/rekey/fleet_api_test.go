package main

import (
	"context"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"
	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/rekey-io/rekey/internal/fleet"
	"github.com/rekey-io/rekey/internal/shimtest"
	"github.com/rekey-io/rekey/pkg/layer"
)

// A fleet entry with a kubeconfig reads the cluster's EncryptionState through its
// apiserver, not its etcd: a Secret its identity rule wrote in plaintext and one put
// under a retired key behind its back both show in the row, which needs attention.
func TestFleetStatusThroughEncryptionStateAPI(t *testing.T) {
	api := shimtest.StartWithFlags(t, layer.Flags{StorageInventoryInterval: 500 * time.Millisecond})
	ctx := context.Background()
	if _, err := api.Client.CoreV1().Secrets("default").Create(ctx, &corev1.Secret{ObjectMeta: metav1.ObjectMeta{Name: "plain"},
		Data: map[string][]byte{"k": []byte("v")}}, metav1.CreateOptions{}); err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: api.EtcdServers, DialTimeout: 5 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(ctx, api.EtcdPrefix+"/secrets/default/retired", "k8s:enc:aesgcm:v1:gone:0123456789abcdef0123456789abcdef"); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(t.TempDir(), "fleet.yaml")
	body := "clusters:\n  - name: through-api\n    kubeconfig: " + api.Kubeconfig + "\n    context: shim\n"
	if err := os.WriteFile(p, []byte(body), 0o600); err != nil {
		t.Fatal(err)
	}
	var row fleet.Row
	for deadline := time.Now().Add(60 * time.Second); ; time.Sleep(200 * time.Millisecond) {
		out, err := run(t, "fleet", "status", "-f", p, "-o", "json", "--progress", "none")
		var rows []fleet.Row
		// The JSON comes first; cobra's "Error: ..." line follows it in the same buffer.
		if jerr := json.NewDecoder(strings.NewReader(out)).Decode(&rows); jerr == nil && len(rows) == 1 {
			row = rows[0]
			if row.Plaintext == 1 && row.Unreadable == 1 {
				if err == nil {
					t.Fatal("a row needing attention did not fail the command")
				}
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatalf("the row never showed the plaintext and the retired-key Secret: %v\n%s", err, out)
		}
	}
	if row.Error != "" || row.APIServers != 1 || row.Objects != 2 || row.NotOnWriteKey != 1 || row.Revision == 0 || row.FIPS == "" {
		t.Errorf("row %+v", row)
	}
	joined := strings.Join(row.Attention, "; ")
	for _, want := range []string{"secrets: written in plaintext (its rule writes identity)", "1 objects in plaintext"} {
		if !strings.Contains(joined, want) {
			t.Errorf("attention %q lacks %q", joined, want)
		}
	}

	// A kubeconfig to a server without the API is a row that says what is missing.
	if err := os.WriteFile(p, []byte("clusters:\n  - name: x\n    kubeconfig: "+api.Kubeconfig+"\n    etcdServers: [http://127.0.0.1:1]\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	if _, err := run(t, "fleet", "status", "-f", p); err == nil || !strings.Contains(err.Error(), "both a kubeconfig and etcd") {
		t.Fatalf("an entry with both: %v", err)
	}
}
