package main

import (
	"bytes"
	"context"
	"encoding/json"
	"os"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/cluster"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// putTotal stores the cluster's total of the write key of path's secrets rule, as the
// apiservers would have added it.
func putTotal(t *testing.T, cli *clientv3.Client, path string, writes uint64, firstSeen time.Time) {
	t.Helper()
	cfg, err := config.Load(path, config.Options{})
	if err != nil {
		t.Fatal(err)
	}
	w, _ := transformers.DescribeRules(cfg)[0].Writer()
	data, err := json.Marshal(cluster.KeyTotal{Key: w, Writes: writes, FirstSeen: firstSeen})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cli.Put(context.Background(), cluster.KeyWritesKey(coordination.DefaultPrefix, w), string(data)); err != nil {
		t.Fatal(err)
	}
}

// TestRotateIfWritesOverOrOlderThan: rotate rotates only when the write key's cluster
// total is over --if-writes-over or its age over --if-older-than, says why either way,
// and exits 0 in both cases, with and without --wait.
func TestRotateIfWritesOverOrOlderThan(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	etcd := []string{"--etcd-servers", srv.Endpoint}
	rotate := func(path string, args ...string) string {
		t.Helper()
		out, err := run(t, append(append([]string{"rotate", "--encryption-provider-config", path}, etcd...), args...)...)
		if err != nil {
			t.Fatalf("rotate %v: %v\n%s", args, err, out)
		}
		return out
	}
	unchanged := func(path string, before []byte) {
		t.Helper()
		if now, _ := os.ReadFile(path); !bytes.Equal(now, before) {
			t.Fatal("rotate changed the file although its condition did not hold")
		}
	}

	// Under both: nothing happens, with or without --wait.
	path := writeConfig(t, "enc.yaml", "key1")
	before, _ := os.ReadFile(path)
	putTotal(t, cli, path, 1_234, time.Now().Add(-3*24*time.Hour-time.Hour))
	for _, extra := range [][]string{nil, {"--wait", "--wait-timeout", "1s"}} {
		out := rotate(path, append([]string{"--if-writes-over", "200000", "--if-older-than", "30d"}, extra...)...)
		if want := "not rotating: key1 sealed 1,234 values, under 200,000, and is 3d old, under 30d\n"; out != want {
			t.Fatalf("rotate %v printed %q, want %q", extra, out, want)
		}
		unchanged(path, before)
	}

	// Over the write budget: rotates.
	putTotal(t, cli, path, 212_345, time.Now().Add(-time.Hour))
	out := rotate(path, "--if-writes-over", "200000", "--if-older-than", "30d")
	if !strings.HasPrefix(out, "key1 sealed 212,345 values (budget 200,000): rotating\n") || !strings.Contains(out, "new write key") {
		t.Fatalf("rotate over budget printed:\n%s", out)
	}
	if keys := fileKeys(t, path); len(keys) != 2 || keys[1] != "key1" {
		t.Fatalf("keys after a rotation over budget: %v, want a new key before key1", keys)
	}

	// Older than the limit (writes under budget): rotates; younger: does not.
	old := writeConfig(t, "old.yaml", "key7")
	putTotal(t, cli, old, 10, time.Now().Add(-40*24*time.Hour))
	before, _ = os.ReadFile(old)
	if out := rotate(old, "--if-older-than", "60d"); out != "not rotating: key7 is 40d old, under 60d\n" {
		t.Fatalf("rotate --if-older-than 60d printed %q", out)
	}
	unchanged(old, before)
	if out := rotate(old, "--if-writes-over", "200000", "--if-older-than", "30d"); !strings.HasPrefix(out, "key7 is 40d old (limit 30d): rotating\n") {
		t.Fatalf("rotate of an old key printed:\n%s", out)
	}

	// A key no apiserver has counted yet is not rotated; the flags need etcd.
	fresh := writeConfig(t, "fresh.yaml", "key9")
	if out := rotate(fresh, "--if-writes-over", "1"); !strings.Contains(out, "not rotating: key9 has not been seen by any apiserver yet") {
		t.Fatalf("rotate of an uncounted key printed %q", out)
	}
	if _, err := run(t, "rotate", "--encryption-provider-config", fresh, "--if-older-than", "1d"); err == nil || !strings.Contains(err.Error(), "--etcd-servers") {
		t.Fatalf("--if-older-than without etcd: %v", err)
	}
	if _, err := run(t, "rotate", "--encryption-provider-config", fresh, "--if-older-than", "1w"); err == nil {
		t.Fatal("--if-older-than 1w was accepted")
	}
}

// The status table and JSON show each key's lifetime total and age.
func TestStatusShowsKeyWrites(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	path := writeConfig(t, "enc.yaml", "key1")
	putTotal(t, cli, path, 212_345, time.Now().Add(-3*24*time.Hour-time.Hour))
	out, _ := run(t, "status", "--etcd-servers", srv.Endpoint)
	if !strings.Contains(out, "KEY WRITES") || !strings.Contains(out, "aesgcm/key1") || !strings.Contains(out, "212,345") || !strings.Contains(out, "3d") {
		t.Fatalf("status table lacks the key's total:\n%s", out)
	}
	out, _ = run(t, "status", "--etcd-servers", srv.Endpoint, "-o", "json")
	var doc struct {
		KeyWrites []cluster.KeyTotal `json:"keyWrites"`
	}
	// No apiserver runs, so status also reports (on stderr) that the cluster has not
	// converged: decode the document only.
	if err := json.NewDecoder(strings.NewReader(out)).Decode(&doc); err != nil || len(doc.KeyWrites) != 1 || doc.KeyWrites[0].Writes != 212_345 {
		t.Fatalf("status json keyWrites %+v (%v)\n%s", doc.KeyWrites, err, out)
	}
}
