package e2e

import (
	"fmt"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/testbed"
	"github.com/rekey-io/rekey/pkg/storagelayout"
)

// everyKind are objects of every kind a *.* rule covers that kube-apiserver and its
// apiextensions and aggregator servers store: built-in groups at kube's own paths
// (Deployments at /registry/deployments/), a custom resource, an APIService, a Lease
// and an Event.
func everyKind(ns string) string {
	return fmt.Sprintf(`apiVersion: v1
kind: Secret
metadata: {name: s1, namespace: %[1]s}
stringData: {password: not-a-real-one}
---
apiVersion: v1
kind: ConfigMap
metadata: {name: cm1, namespace: %[1]s}
data: {k: v}
---
apiVersion: apps/v1
kind: Deployment
metadata: {name: web, namespace: %[1]s}
spec:
  replicas: 1
  selector: {matchLabels: {app: web}}
  template:
    metadata: {labels: {app: web}}
    spec: {containers: [{name: c, image: example.invalid/web:1}]}
---
apiVersion: coordination.k8s.io/v1
kind: Lease
metadata: {name: l1, namespace: %[1]s}
spec: {holderIdentity: e2e}
---
apiVersion: v1
kind: Event
metadata: {name: ev1, namespace: %[1]s}
involvedObject: {kind: ConfigMap, name: cm1, namespace: %[1]s}
reason: Testing
message: stored under the *.* rule
type: Normal
---
apiVersion: apiregistration.k8s.io/v1
kind: APIService
metadata: {name: v1alpha1.rekey.example.io}
spec:
  group: rekey.example.io
  version: v1alpha1
  groupPriorityMinimum: 100
  versionPriority: 10
  insecureSkipTLSVerify: true
  service: {namespace: %[1]s, name: nothing-serves-this, port: 443}
---
apiVersion: example.com/v1
kind: Widget
metadata: {name: w1, namespace: %[1]s}
spec: {size: 3}
`, ns)
}

// storedAESGCMPrefix matches the stored prefix of an aesgcm value.
var storedAESGCMPrefix = regexp.MustCompile(`^k8s:enc:aesgcm:v1:[^:]+:`)

// everyKindRefs are the objects of everyKind as kubectl names them.
func everyKindRefs(ns string) [][]string {
	return [][]string{
		{"secret", "s1", "-n", ns}, {"configmap", "cm1", "-n", ns}, {"deployment.apps", "web", "-n", ns},
		{"lease.coordination.k8s.io", "l1", "-n", ns}, {"event", "ev1", "-n", ns},
		{"apiservice", "v1alpha1.rekey.example.io"}, {"widget.example.com", "w1", "-n", ns},
		{"customresourcedefinition", "widgets.example.com"},
	}
}

// "Encrypt everything" rotates end to end on kube-apiserver with rekey: with an
// explicit deployments.apps rule and a *.* rule, both on key1, `rekey rotate --wait`
// adds key2, promotes it, has the stored data migrated and removes key1. Then every
// value under the etcd prefix — Secrets, ConfigMaps, Deployments (at kube's own path),
// a custom resource and its definition, an APIService, Leases, Events, and what
// kube-apiserver stores by itself — is under key2 (the allocator and endpoint-lease
// keys kube-apiserver writes without transformers aside), key1 is gone from the file,
// and an unmodified upstream kube-apiserver reads every object with the final file. The
// rotation shows in Kubernetes' own tools: Events about the apiserver's identity Lease
// and StorageVersionMigrations that reached Succeeded.
func TestKubeAPIServerRotatesEverything(t *testing.T) {
	kapi := kubeAPIServers(t)
	ctx := t.Context()
	dir := t.TempDir()
	config := filepath.Join(dir, "encryption.yaml")
	key1 := testbed.RandomKey()
	writeConfig(t, config, configOf(rule("deployments.apps", aesgcm("key1", key1)), rule("*.*", aesgcm("key1", key1))))
	saKey := filepath.Join(dir, "sa.key")
	if err := testbed.WriteServiceAccountKey(saKey); err != nil {
		t.Fatal(err)
	}
	prefix := uniquePrefix(t)
	ours := startKubeAPIServer(t, kapi.Rekey, testbed.KubeAPIServerConfig{Name: "kapi-everything", Dir: filepath.Join(dir, "ours"),
		EtcdPrefix: prefix, ServiceAccountKey: saKey, EncryptionConfig: config, AutomaticReload: true,
		Args: []string{"--encryption-provider-config-poll-interval", "1s", "--storage-migration-check-interval", "1s"}})

	ns := "kapi-everything"
	if _, err := ours.Kubectl(ctx, "", "create", "namespace", ns); err != nil {
		t.Fatal(err)
	}
	if out, err := ours.Kubectl(ctx, widgetCRD, "apply", "-f", "-"); err != nil {
		t.Fatalf("creating the CRD: %v\n%s", err, out)
	}
	if out, err := ours.Kubectl(ctx, "", "wait", "--for", "condition=established", "--timeout", "60s", "crd/widgets.example.com"); err != nil {
		t.Fatalf("waiting for the CRD: %v\n%s", err, out)
	}
	eventually(t, 60*time.Second, 500*time.Millisecond, "every kind created", func() error {
		out, err := ours.Kubectl(ctx, everyKind(ns), "apply", "-f", "-")
		if err != nil {
			return fmt.Errorf("%v: %s", err, out)
		}
		return nil
	})

	cli, err := testbed.EtcdClient([]string{etcd.Endpoint})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	// scan returns, per stored directory, how many values are under each stored
	// prefix ("k8s:enc:aesgcm:v1:key1:"; "plaintext" for anything else).
	scan := func() map[string]map[string]int {
		t.Helper()
		resp, err := cli.Get(ctx, prefix+"/", clientv3.WithPrefix())
		if err != nil {
			t.Fatal(err)
		}
		layout := storagelayout.Kube(prefix)
		out := map[string]map[string]int{}
		for _, kv := range resp.Kvs {
			loc, ok := layout.Owner(string(kv.Key))
			if !ok {
				continue // written by kube-apiserver without transformers (allocators, endpoint leases)
			}
			stored := "plaintext"
			if m := storedAESGCMPrefix.Find(kv.Value); m != nil {
				stored = string(m)
			}
			if out[loc.KeyPrefix] == nil {
				out[loc.KeyPrefix] = map[string]int{}
			}
			out[loc.KeyPrefix][stored]++
		}
		return out
	}
	before := scan()
	for _, dir := range []string{"/deployments/", "/example.com/widgets/", "/apiregistration.k8s.io/apiservices/", "/leases/", "/events/", "/secrets/", "/configmaps/", "/apiextensions.k8s.io/customresourcedefinitions/"} {
		if before[prefix+dir]["k8s:enc:aesgcm:v1:key1:"] == 0 {
			t.Fatalf("before the rotation nothing under key1 at %s%s: %v", prefix, dir, before)
		}
	}

	secretsBefore := fileSecrets(t, config)
	rotateArgs := []string{"rotate", "--encryption-provider-config", config, "--wait",
		"--etcd-servers", etcd.Endpoint, "--etcd-prefix", prefix, "--coordination-prefix", coordinationPrefix(t),
		"--wait-timeout", "4m", "--progress", "plain"}
	out, err := runRotateWait(ctx, t, rekeyBin(t), rotateArgs)
	if err != nil {
		t.Fatalf("rekey rotate --wait: %v\n%s", err, out)
	}
	if strings.Contains(out, "added no key; run rekey rotate --wait again") {
		// kube-apiserver's first migration after its start (every resource verified
		// under key1) was still running, which rotate --wait takes for a rotation in
		// progress and finishes (on a loaded machine it can last that long); as its
		// output says, a second run adds the key.
		if out, err = runRotateWait(ctx, t, rekeyBin(t), rotateArgs); err != nil {
			t.Fatalf("rekey rotate --wait, the second run: %v\n%s", err, out)
		}
	}
	// One new key in each rule, key1 in none: deployments.apps's first, *.*'s second.
	names := sourceKeys(t, config)
	if slices.Contains(names, "key1") || len(names) != 2 {
		t.Fatalf("after the rotation the file's keys are %v, want one new key in each rule and no key1", names)
	}
	after := scan()
	for dir, byPrefix := range after {
		want := "k8s:enc:aesgcm:v1:" + names[1] + ":"
		if dir == prefix+"/deployments/" {
			want = "k8s:enc:aesgcm:v1:" + names[0] + ":"
		}
		for stored, n := range byPrefix {
			if stored != want {
				t.Errorf("%s: %d values under %s after the rotation, want all under %s", dir, n, stored, want)
			}
		}
	}
	if t.Failed() {
		t.FailNow()
	}
	cs := clientFor(t, ours)
	checkRotationEvents(t, cs, identityLease(t, cs), "aesgcm/key1", append(secretsBefore, fileSecrets(t, config)...))

	// Unmodified upstream kube-apiserver of the same version, on the same data with the
	// final file, reads every object.
	theirs := startKubeAPIServer(t, kapi.Upstream, testbed.KubeAPIServerConfig{Name: "kapi-upstream-reader", Dir: filepath.Join(dir, "theirs"),
		EtcdPrefix: prefix, ServiceAccountKey: saKey, EncryptionConfig: config})
	for _, ref := range everyKindRefs(ns) {
		eventually(t, 30*time.Second, 500*time.Millisecond, "upstream reads "+strings.Join(ref, " "), func() error {
			out, err := theirs.Kubectl(ctx, "", append([]string{"get", "-o", "name"}, ref...)...)
			if err != nil {
				return fmt.Errorf("%v: %s", err, out)
			}
			return nil
		})
	}
}
