// Package e2e runs the apiserver shim, etcd and the KMS v2 plugin as real processes
// and drives them with kubectl and client-go. The binaries are built once per run
// with the version ldflags; one etcd process is shared and every test uses its own
// namespaces.
package e2e

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"k8s.io/client-go/kubernetes"

	"github.com/rekey-io/rekey/internal/testbed"
)

var (
	bins testbed.Binaries
	etcd *testbed.Etcd
)

func TestMain(m *testing.M) {
	os.Exit(testbed.MainWithLeakCheck(func() int { return runMain(m) }))
}

func runMain(m *testing.M) int {
	if _, err := os.Stat(testbed.KubectlPath()); err != nil {
		fmt.Fprintf(os.Stderr, "e2e: kubectl is required (%v); set KUBECTL or put one on PATH (.ci/run builds one)\n", err)
		return 1
	}
	dir, err := os.MkdirTemp("", "rekey-e2e-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)
	workDir = dir
	ctx := context.Background()
	start := time.Now()
	if bins, err = testbed.Build(ctx, filepath.Join(dir, "bin")); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	fmt.Fprintf(os.Stderr, "e2e: built binaries in %v\n", time.Since(start).Round(time.Millisecond))
	if etcd, err = testbed.StartEtcd(ctx, bins.Etcd, dir); err != nil {
		fmt.Fprintln(os.Stderr, "e2e:", err)
		return 1
	}
	defer etcd.Stop(10 * time.Second)
	return m.Run()
}

// startShim starts a shim on the shared etcd and stops it when the test ends.
func startShim(t *testing.T, c testbed.ShimConfig) *testbed.Shim {
	t.Helper()
	if c.Dir == "" {
		c.Dir = t.TempDir()
	}
	if c.EtcdServers == nil {
		c.EtcdServers = []string{etcd.Endpoint}
	}
	if !slices.ContainsFunc(c.Args, func(a string) bool { return strings.HasPrefix(a, "--coordination-prefix") }) {
		// Tests share one etcd but are separate clusters: each coordinates under its own prefix.
		c.Args = append(c.Args, "--coordination-prefix", coordinationPrefix(t))
	}
	s, err := testbed.StartShim(t.Context(), bins.Shim, c)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		s.Stop(15 * time.Second)
		if t.Failed() {
			t.Logf("%s log tail:\n%s", s.Name, s.Log(3000))
		}
	})
	return s
}

// startPlugin starts the KMS v2 plugin with one key and stops it when the test ends.
func startPlugin(t *testing.T, dir string) *testbed.Plugin {
	t.Helper()
	sockDir := shortTempDir(t)
	p, err := testbed.StartPlugin(t.Context(), bins.Plugin, dir, sockDir, testbed.PluginKey{Name: "kek-1", Secret: testbed.RandomKey()})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Stop(5 * time.Second) })
	return p
}

// shortTempDir is a temp dir with a short path, for unix sockets.
func shortTempDir(t *testing.T) string {
	t.Helper()
	d, err := os.MkdirTemp("", "kms")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(d) })
	return d
}

func clientFor(t *testing.T, s *testbed.Shim) *kubernetes.Clientset {
	t.Helper()
	c, err := kubernetes.NewForConfig(s.RESTConfig())
	if err != nil {
		t.Fatal(err)
	}
	return c
}

// provider renders one provider entry of an EncryptionConfiguration.
func aesgcm(name, secret string) string {
	return fmt.Sprintf("  - aesgcm:\n      keys: [{name: %s, secret: %q}]\n", name, secret)
}

func aescbc(name, secret string) string {
	return fmt.Sprintf("  - aescbc:\n      keys: [{name: %s, secret: %q}]\n", name, secret)
}

func kms(name, endpoint string) string {
	return fmt.Sprintf("  - kms:\n      apiVersion: v2\n      name: %s\n      endpoint: %s\n      timeout: 2s\n", name, endpoint)
}

const identity = "  - identity: {}\n"

// encryptionConfig renders a config with the providers of secrets and configmaps.
func encryptionConfig(secrets, configmaps []string) string {
	var b strings.Builder
	b.WriteString("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n")
	b.WriteString("- resources: [secrets]\n  providers:\n" + strings.Join(secrets, ""))
	b.WriteString("- resources: [configmaps]\n  providers:\n" + strings.Join(configmaps, ""))
	return b.String()
}

func writeConfig(t *testing.T, path, content string) {
	t.Helper()
	if err := testbed.WriteFileAtomic(path, []byte(content)); err != nil {
		t.Fatal(err)
	}
}

// eventually retries f every interval until it succeeds or timeout passes.
func eventually(t *testing.T, timeout, interval time.Duration, what string, f func() error) {
	t.Helper()
	deadline := time.Now().Add(timeout)
	for {
		err := f()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: not within %v: %v", what, timeout, err)
		}
		time.Sleep(interval)
	}
}

// rekeyCLI builds cmd/rekey once per run (testbed.Build builds the servers only).
var rekeyCLI struct {
	once sync.Once
	path string
	err  error
}

func rekeyBin(t testing.TB) string {
	t.Helper()
	rekeyCLI.once.Do(func() {
		rekeyCLI.path, rekeyCLI.err = testbed.BuildRekey(context.Background(), filepath.Join(workDir, "bin"))
	})
	if rekeyCLI.err != nil {
		t.Fatal(rekeyCLI.err)
	}
	return rekeyCLI.path
}
