package main

import (
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// TestCommandsOverTLSEtcd runs every command against an etcd that requires a client
// certificate, with kube-apiserver's --etcd-cafile/--etcd-certfile/--etcd-keyfile, and
// checks that leaving the client certificate out fails with an error naming the flags.
func TestCommandsOverTLSEtcd(t *testing.T) {
	srv := etcdtest.StartWith(t, etcdtest.Options{TLS: true})
	cfg := writeConfig(t, "enc.yaml", "key1")
	seed(t, srv.Client(t), cfg, 3)
	withCert := []string{"--etcd-servers", srv.Endpoint, "--etcd-cafile", srv.TLS.CAFile,
		"--etcd-certfile", srv.TLS.ClientCertFile, "--etcd-keyfile", srv.TLS.ClientKeyFile, "--etcd-dial-timeout", "3s"}
	caOnly := []string{"--etcd-servers", srv.Endpoint, "--etcd-cafile", srv.TLS.CAFile, "--etcd-dial-timeout", "3s"}

	commands := map[string][]string{
		"inventory":    {"inventory", "--encryption-provider-config", cfg},
		"check-config": {"check-config", "--encryption-provider-config", cfg, "--new", cfg},
		"migrate":      {"migrate", "--encryption-provider-config", cfg},
		"status":       {"status"},
	}
	for name, args := range commands {
		t.Run(name, func(t *testing.T) {
			out, err := run(t, append(append([]string{}, args...), withCert...)...)
			if err != nil && !(name == "status" && strings.Contains(err.Error(), "not converged")) {
				t.Fatalf("%s over TLS with a client certificate: %v\n%s", name, err, out)
			}
			out, err = run(t, append(append([]string{}, args...), caOnly...)...)
			if err == nil {
				t.Fatalf("%s without a client certificate succeeded against an etcd that requires one:\n%s", name, out)
			}
			if !strings.Contains(err.Error(), "TLS flags") {
				t.Errorf("%s without a client certificate: error %q does not point to the TLS flags", name, err)
			}
		})
	}
}
