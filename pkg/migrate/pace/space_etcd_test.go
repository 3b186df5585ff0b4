package pace

import (
	"context"
	"net"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
)

// A member that is down must not stall the space reading (the migration waits for it):
// the members that answer say how full etcd is, within the grace after the first answer.
// The member down here accepts connections and never answers (a host gone behind a
// load balancer, a stopped process's socket), so only the grace ends its wait; the
// timeout is long enough that a machine busy with other tests is not taken for waiting.
func TestReadSpaceWithAMemberDown(t *testing.T) {
	srv := etcdtest.Start(t)
	silent, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer silent.Close()
	go func() {
		var held []net.Conn
		defer func() {
			for _, c := range held {
				c.Close()
			}
		}()
		for {
			c, err := silent.Accept()
			if err != nil {
				return
			}
			held = append(held, c)
		}
	}()
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint, "http://" + silent.Addr().String()}, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	const timeout = 20 * time.Second
	start := time.Now()
	s := readSpace(context.Background(), cli, timeout)
	if s.Err != nil || s.DBSize == 0 {
		t.Fatalf("readSpace with one member down = %+v", s)
	}
	if took := time.Since(start); took > timeout/2 {
		t.Errorf("readSpace took %v with one member down: it waited for the silent one", took)
	}
}
