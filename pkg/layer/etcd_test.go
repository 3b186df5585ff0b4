package layer

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// The layer's clients connect as the storage backend does: with the client pair they
// reach an etcd that requires one; without it Check fails naming the TLS flags, and a
// missing file is reported before any dial.
func TestEtcdTLS(t *testing.T) {
	srv := etcdtest.StartWith(t, etcdtest.Options{TLS: true})
	ctx := context.Background()
	full := Etcd{Servers: []string{srv.Endpoint}, CAFile: srv.TLS.CAFile, CertFile: srv.TLS.ClientCertFile, KeyFile: srv.TLS.ClientKeyFile}
	if err := full.Check(ctx, 5*time.Second, "unused"); err != nil {
		t.Fatalf("Check with the client certificate: %v", err)
	}
	cli, err := full.NewClient()
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	if _, err := cli.Put(ctx, "/rekey-layer-test", "v"); err != nil {
		t.Fatalf("put over TLS: %v", err)
	}

	caOnly := Etcd{Servers: []string{srv.Endpoint}, CAFile: srv.TLS.CAFile}
	err = caOnly.Check(ctx, 2*time.Second, "plaintext hint")
	if err == nil {
		t.Fatal("Check without a client certificate succeeded against an etcd that requires one")
	}
	if !strings.Contains(err.Error(), "--etcd-certfile") || strings.Contains(err.Error(), "plaintext hint") {
		t.Errorf("error %q should point to the TLS flags", err)
	}

	missing := Etcd{Servers: []string{srv.Endpoint}, CAFile: srv.TLS.CAFile, CertFile: "/nonexistent/client.crt", KeyFile: "/nonexistent/client.key"}
	if _, err := missing.NewClient(); err == nil || !strings.Contains(err.Error(), "--etcd-certfile") {
		t.Errorf("NewClient with a missing certificate file: %v", err)
	}
}
