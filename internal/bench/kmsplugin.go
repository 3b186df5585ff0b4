package bench

import (
	"fmt"
	"os"
	"path/filepath"

	"github.com/rekey-io/rekey/internal/kmsplugin"
)

// kmsEnv is an in-process local KMS v2 plugin on a unix socket.
type kmsEnv struct {
	dir      string
	endpoint string
	server   *kmsplugin.Server
}

// startKMS starts the plugin with one random key; close stops it.
func startKMS() (*kmsEnv, error) {
	dir, err := os.MkdirTemp("", "rkb")
	if err != nil {
		return nil, err
	}
	keys := filepath.Join(dir, "keys.yaml")
	if err := os.WriteFile(keys, []byte("keys:\n- name: bench-key-1\n  secret: "+randomKey(32)+"\n"), 0o600); err != nil {
		return nil, err
	}
	endpoint := "unix://" + filepath.Join(dir, "kms.sock")
	s, err := kmsplugin.Start(kmsplugin.Options{ListenAddr: endpoint, KeysFile: keys})
	if err != nil {
		os.RemoveAll(dir)
		return nil, err
	}
	return &kmsEnv{dir: dir, endpoint: endpoint, server: s}, nil
}

func (e *kmsEnv) close() {
	e.server.Stop()
	os.RemoveAll(e.dir)
}

// yaml is a config that encrypts Secrets with the plugin as KMS v2 provider name.
func (e *kmsEnv) yaml(name string) string {
	return fmt.Sprintf("apiVersion: apiserver.config.k8s.io/v1\nkind: EncryptionConfiguration\nresources:\n  - resources: [secrets]\n    providers:\n      - kms:\n          apiVersion: v2\n          name: %s\n          endpoint: %s\n          timeout: 3s\n", name, e.endpoint)
}
