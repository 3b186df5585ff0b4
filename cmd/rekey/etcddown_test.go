package main

import (
	"strconv"
	"strings"
	"testing"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/freeport"
)

// Every command works while one endpoint of --etcd-servers is down, whichever place it
// has in the list: a member of three down for an upgrade or a reboot is routine. The
// commands checked only the first URL before, and gave up after the dial timeout.
func TestCommandsWorkWithAnEtcdEndpointDown(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	cfg := writeConfig(t, "cfg.yaml", "key1")
	seed(t, cli, cfg, 20)
	port, err := freeport.Pick() // nothing listens there
	if err != nil {
		t.Fatal(err)
	}
	down := "http://127.0.0.1:" + strconv.Itoa(port)
	for _, servers := range []string{down + "," + srv.Endpoint, srv.Endpoint + "," + down} {
		out, err := run(t, "inventory", "--encryption-provider-config", cfg, "--etcd-servers", servers)
		if err != nil || !strings.Contains(out, "secrets: 20 objects") {
			t.Fatalf("inventory with --etcd-servers %s: %v\n%s", servers, err, out)
		}
	}
	// With every endpoint down the error names them all.
	_, err = run(t, "inventory", "--encryption-provider-config", cfg, "--etcd-servers", down, "--etcd-dial-timeout", "1s")
	if err == nil || !strings.Contains(err.Error(), down) {
		t.Fatalf("inventory with etcd down: %v, want an error naming %s", err, down)
	}
}
