package testbed

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/x509"
	"encoding/pem"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"
)

// KubeAPIServerDir is dist/kube-apiserver, a Go module of its own, relative to the
// module root.
const KubeAPIServerDir = "dist/kube-apiserver"

// KubeAPIServerBinaries are kube-apiserver built with rekey inside and, from the same
// module graph, upstream's unmodified command.
type KubeAPIServerBinaries struct {
	Rekey, Upstream string
}

// BuildKubeAPIServer builds dist/kube-apiserver into dir and, when upstream is set,
// k8s.io/kubernetes/cmd/kube-apiserver of the same version next to it, both with
// VersionLDFlags. The first build compiles k8s.io/kubernetes: many minutes on a cold
// cache. With PrebuiltEnv set, it returns those already built there.
func BuildKubeAPIServer(ctx context.Context, dir string, upstream bool) (KubeAPIServerBinaries, error) {
	names := []string{"kube-apiserver"}
	if upstream {
		names = append(names, "kube-apiserver-upstream")
	}
	if pre := prebuilt(PrebuiltKubeAPIServer, names...); pre != "" {
		dir = pre
	} else if err := buildKubeAPIServer(ctx, dir, upstream); err != nil {
		return KubeAPIServerBinaries{}, err
	}
	b := KubeAPIServerBinaries{Rekey: filepath.Join(dir, "kube-apiserver")}
	if upstream {
		b.Upstream = filepath.Join(dir, "kube-apiserver-upstream")
	}
	return b, nil
}

func buildKubeAPIServer(ctx context.Context, dir string, upstream bool) error {
	root, err := ModuleRoot()
	if err != nil {
		return err
	}
	builds := [][2]string{{filepath.Join(dir, "kube-apiserver"), "."}}
	if upstream {
		builds = append(builds, [2]string{filepath.Join(dir, "kube-apiserver-upstream"), "k8s.io/kubernetes/cmd/kube-apiserver"})
	}
	// One after the other: the second only compiles its main package and links.
	for _, bl := range builds {
		cmd := exec.CommandContext(ctx, "go", "build", "-ldflags", VersionLDFlags+" -X main.rekeyVersion=testbed", "-o", bl[0], bl[1])
		cmd.Dir = filepath.Join(root, KubeAPIServerDir)
		cmd.Env = BuildEnv() // with the FIPS module in FIPS mode
		if out, err := cmd.CombinedOutput(); err != nil {
			return fmt.Errorf("go build %s in %s: %w\n%s", bl[1], cmd.Dir, err, out)
		}
	}
	return nil
}

// KubeAPIServerConfig configures a kube-apiserver process with the smallest set of flags
// it starts with: etcd, serving on loopback with a self-signed certificate, a token file
// with an admin in system:masters, RBAC, service-account keys and a service IP range.
type KubeAPIServerConfig struct {
	// Name names the process and its log file (default "kube-apiserver").
	Name string
	// Dir holds certificates, the token file and the kubeconfig.
	Dir         string
	EtcdServers []string
	// EtcdPrefix is --etcd-prefix; apiservers of one cluster share it.
	EtcdPrefix string
	// ServiceAccountKey is a PEM private key file; apiservers of one cluster share it.
	// Empty: one is generated in Dir.
	ServiceAccountKey string
	// EncryptionConfig is --encryption-provider-config when set.
	EncryptionConfig string
	// AutomaticReload is --encryption-provider-config-automatic-reload.
	AutomaticReload bool
	// Args are appended to the command line.
	Args []string
}

// WriteServiceAccountKey writes a new ECDSA P-256 private key (PEM) to path.
func WriteServiceAccountKey(path string) error {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return err
	}
	der, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return err
	}
	return os.WriteFile(path, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: der}), 0o600)
}

// KubeAPIServerArgs returns the command line StartKubeAPIServer uses for port, with the
// token file (and service-account key, if not given) written into c.Dir.
func KubeAPIServerArgs(c KubeAPIServerConfig, port int) ([]string, error) {
	if err := os.MkdirAll(c.Dir, 0o700); err != nil {
		return nil, err
	}
	tokens := filepath.Join(c.Dir, "tokens.csv")
	if err := os.WriteFile(tokens, []byte(adminToken+",admin,admin-uid,\"system:masters\"\n"), 0o600); err != nil {
		return nil, err
	}
	if c.ServiceAccountKey == "" {
		c.ServiceAccountKey = filepath.Join(c.Dir, "sa.key")
		if err := WriteServiceAccountKey(c.ServiceAccountKey); err != nil {
			return nil, err
		}
	}
	args := []string{
		"--etcd-servers", strings.Join(c.EtcdServers, ","),
		"--secure-port", strconv.Itoa(port), "--bind-address", "127.0.0.1", "--advertise-address", "127.0.0.1",
		"--cert-dir", filepath.Join(c.Dir, "certs"),
		"--token-auth-file", tokens,
		"--authorization-mode", "RBAC",
		"--service-account-issuer", "https://kubernetes.default.svc.cluster.local",
		"--service-account-key-file", c.ServiceAccountKey,
		"--service-account-signing-key-file", c.ServiceAccountKey,
		"--service-cluster-ip-range", "10.96.0.0/24",
		// Test apiservers share an etcd and an advertise address; none of them owns the
		// kubernetes Service's endpoints.
		"--endpoint-reconciler-type", "none",
	}
	if c.EtcdPrefix != "" {
		args = append(args, "--etcd-prefix", c.EtcdPrefix)
	}
	if c.EncryptionConfig != "" {
		args = append(args, "--encryption-provider-config", c.EncryptionConfig,
			"--encryption-provider-config-automatic-reload="+strconv.FormatBool(c.AutomaticReload))
	}
	return append(args, c.Args...), nil
}

// StartKubeAPIServer starts kube-apiserver and waits until /readyz answers 200 to the
// admin. The returned Shim is the same handle the shim tests use (URL, CA, token,
// kubeconfig, clients).
func StartKubeAPIServer(ctx context.Context, bin string, c KubeAPIServerConfig) (*Shim, error) {
	if c.Name == "" {
		c.Name = "kube-apiserver"
	}
	return retryLostPort(func() (*Shim, error) { return startKubeAPIServer(ctx, bin, c) })
}

// LaunchKubeAPIServer starts kube-apiserver without waiting for it to listen or be
// ready (one whose KMS plugin is absent is not ready): the caller polls what it needs.
// Its kubeconfig is written at once.
func LaunchKubeAPIServer(bin string, c KubeAPIServerConfig) (*Shim, error) {
	if c.Name == "" {
		c.Name = "kube-apiserver"
	}
	port, err := FreePort()
	if err != nil {
		return nil, err
	}
	args, err := KubeAPIServerArgs(c, port)
	if err != nil {
		return nil, err
	}
	p, err := Start(c.Name, c.Dir, bin, args...)
	if err != nil {
		return nil, err
	}
	s := &Shim{Process: p, Token: adminToken, Port: port, URL: "https://127.0.0.1:" + strconv.Itoa(port),
		CAFile: filepath.Join(c.Dir, "certs", "apiserver.crt"), Kubeconfig: filepath.Join(c.Dir, "kubeconfig")}
	if err := os.WriteFile(s.Kubeconfig, []byte(Kubeconfig(s.URL, s.CAFile, s.Token)), 0o600); err != nil {
		p.Kill()
		return nil, err
	}
	return s, nil
}

func startKubeAPIServer(ctx context.Context, bin string, c KubeAPIServerConfig) (*Shim, error) {
	start := time.Now()
	s, err := LaunchKubeAPIServer(bin, c)
	if err != nil {
		return nil, err
	}
	p := s.Process
	ctx, cancel := context.WithTimeout(ctx, 3*time.Minute)
	defer cancel()
	err = poll(ctx, p, 50*time.Millisecond, func() error {
		hc, err := s.HTTPClient(true)
		if err != nil {
			return err
		}
		resp, err := hc.Get(s.URL + "/readyz")
		if err != nil {
			return err
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return fmt.Errorf("/readyz: %d", resp.StatusCode)
		}
		return nil
	})
	if err != nil {
		p.Kill()
		return nil, fmt.Errorf("%s not ready: %w\n%s", c.Name, err, p.Log(3000))
	}
	s.Ready = time.Since(start)
	return s, nil
}
