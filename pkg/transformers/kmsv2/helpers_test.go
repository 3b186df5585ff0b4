package kmsv2

import (
	"context"
	"crypto/rand"
	"encoding/base64"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apiserver/pkg/apis/apiserver"
	"k8s.io/component-base/metrics"

	"github.com/rekey-io/rekey/internal/kmsplugin"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// testPlugin is a real kms-plugin on a real unix socket.
type testPlugin struct {
	*kmsplugin.Server
	dir      string
	endpoint string
	keysFile string
}

func newKey() string {
	b := make([]byte, 32)
	_, _ = rand.Read(b)
	return base64.StdEncoding.EncodeToString(b)
}

// startPlugin starts a plugin whose keys file holds the named keys (first active).
func startPlugin(tb testing.TB, keys ...string) *testPlugin {
	tb.Helper()
	dir, err := os.MkdirTemp("", "kms")
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { os.RemoveAll(dir) })
	tp := &testPlugin{dir: dir, keysFile: filepath.Join(dir, "keys.yaml"), endpoint: "unix://" + filepath.Join(dir, "p.sock")}
	tp.writeKeys(tb, keys...)
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: tp.endpoint, KeysFile: tp.keysFile})
	if err != nil {
		tb.Fatal(err)
	}
	tp.Server = s
	tb.Cleanup(s.Stop)
	return tp
}

var keySecrets = map[string]string{}

// writeKeys rewrites the keys file; a key keeps its secret across rewrites.
func (tp *testPlugin) writeKeys(tb testing.TB, names ...string) {
	tb.Helper()
	var b strings.Builder
	b.WriteString("keys:\n")
	for _, n := range names {
		s, ok := keySecrets[n]
		if !ok {
			s = newKey()
			keySecrets[n] = s
		}
		fmt.Fprintf(&b, "- name: %s\n  secret: %s\n", n, s)
	}
	tmp := tp.keysFile + ".tmp"
	if err := os.WriteFile(tmp, []byte(b.String()), 0o600); err != nil {
		tb.Fatal(err)
	}
	if err := os.Rename(tmp, tp.keysFile); err != nil {
		tb.Fatal(err)
	}
}

func kmsConfig(name, endpoint string) *apiserver.KMSConfiguration {
	return &apiserver.KMSConfiguration{APIVersion: "v2", Name: name, Endpoint: endpoint, Timeout: &metav1.Duration{Duration: 3 * time.Second}}
}

// newProvider starts one of our providers against endpoint and waits until it can write.
func newProvider(tb testing.TB, name, endpoint string, o FactoryOptions) *Provider {
	tb.Helper()
	return newProviderWith(tb, name, endpoint, transformers.Options{APIServerID: "test"}, o)
}

// newProviderWith is newProvider with the transformers' options (e.g. a fake clock).
func newProviderWith(tb testing.TB, name, endpoint string, topts transformers.Options, o FactoryOptions) *Provider {
	tb.Helper()
	if o.Registry == nil && o.Metrics == nil {
		o.Registry = metrics.NewKubeRegistry()
	}
	p, err := New(kmsConfig(name, endpoint), topts, o)
	if err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(p.Close)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if err := p.WaitReady(ctx); err != nil {
		tb.Fatal(err)
	}
	return p
}

// upstreamConfig writes an EncryptionConfiguration for kube-apiserver's loader.
func upstreamConfig(tb testing.TB, dir, name, endpoint string) string {
	tb.Helper()
	path := filepath.Join(dir, name+".yaml")
	cfg := fmt.Sprintf(`apiVersion: apiserver.config.k8s.io/v1
kind: EncryptionConfiguration
resources:
- resources: ["secrets"]
  providers:
  - kms:
      apiVersion: v2
      name: %s
      endpoint: %s
      timeout: 3s
`, name, endpoint)
	if err := os.WriteFile(path, []byte(cfg), 0o600); err != nil {
		tb.Fatal(err)
	}
	return path
}
