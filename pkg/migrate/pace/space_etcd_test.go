package pace

import (
	"context"
	"fmt"
	"testing"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/internal/freeport"
)

// A member that is down must not stall the space reading (the migration waits for it):
// the members that answer say how full etcd is, within the grace after the first answer.
func TestReadSpaceWithAMemberDown(t *testing.T) {
	srv := etcdtest.Start(t)
	port, err := freeport.Pick()
	if err != nil {
		t.Fatal(err)
	}
	cli, err := clientv3.New(clientv3.Config{Endpoints: []string{srv.Endpoint, fmt.Sprintf("http://127.0.0.1:%d", port)}, DialTimeout: time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer cli.Close()
	start := time.Now()
	s := readSpace(context.Background(), cli, maxEtcdAttemptTimeout)
	if s.Err != nil || s.DBSize == 0 {
		t.Fatalf("readSpace with one member down = %+v", s)
	}
	if took := time.Since(start); took > maxEtcdAttemptTimeout/2 {
		t.Errorf("readSpace took %v with one member down: it waited for the dead one", took)
	}
}
