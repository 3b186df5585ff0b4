package cluster

import (
	"context"
	"errors"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/migrate"
)

// etcdTimeout bounds one coordination request.
const etcdTimeout = 5 * time.Second

// errNotLeader is returned by a write guarded by leadership after it was lost.
var errNotLeader = errors.New("not the migration leader any more")

// etcdCheckpoints is a migrate.CheckpointStore at one etcd key. When Guard is set, a
// Save only succeeds while Guard holds (e.g. this apiserver still owns the leader
// key), so a deposed leader cannot overwrite its successor's progress.
type etcdCheckpoints struct {
	Client *clientv3.Client
	Key    string
	Guard  []clientv3.Cmp
}

var _ migrate.CheckpointStore = (*etcdCheckpoints)(nil)

// Load reads the checkpoint; none is (nil, nil).
func (e *etcdCheckpoints) Load(ctx context.Context) (*migrate.Checkpoint, error) {
	ctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	resp, err := e.Client.Get(ctx, e.Key)
	if err != nil {
		return nil, fmt.Errorf("reading the migration checkpoint at %s: %w", e.Key, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	return migrate.DecodeCheckpoint(resp.Kvs[0].Value, e.String())
}

// Save writes c.
func (e *etcdCheckpoints) Save(c *migrate.Checkpoint) error {
	data, err := c.Encode()
	if err != nil {
		return err
	}
	return guardedPut(e.Client, e.Key, data, e.Guard)
}

func (e *etcdCheckpoints) String() string { return "etcd key " + e.Key }

// guardedPut puts value at key if every guard compares true.
func guardedPut(cli *clientv3.Client, key string, value []byte, guard []clientv3.Cmp) error {
	ctx, cancel := context.WithTimeout(context.Background(), etcdTimeout)
	defer cancel()
	resp, err := cli.Txn(ctx).If(guard...).Then(clientv3.OpPut(key, string(value))).Commit()
	if err != nil {
		return fmt.Errorf("writing %s: %w", key, err)
	}
	if !resp.Succeeded {
		return fmt.Errorf("writing %s: %w", key, errNotLeader)
	}
	return nil
}
