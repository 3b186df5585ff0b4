package cluster

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"fmt"
	"path"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/coordination"
)

// Identity is the cluster's identity, created once at <prefix>/cluster by the first
// apiserver that coordinates under that prefix. It binds the coordination prefix to
// one --etcd-prefix: two clusters that share an etcd (and, by mistake, a coordination
// prefix) cannot count each other as members. Every member record carries ClusterID;
// a record with another one is an unknown member (UnknownMember).
type Identity struct {
	// ClusterID is random (crypto/rand.Text: 26 base32 characters), never derived from
	// anything secret.
	ClusterID string `json:"clusterID"`
	// EtcdPrefix is the resource prefix (--etcd-prefix, cleaned) the cluster stores
	// its objects under.
	EtcdPrefix string `json:"etcdPrefix"`
	// CreatedAt and CreatedBy say which apiserver created it, and when.
	CreatedAt time.Time `json:"createdAt"`
	CreatedBy string    `json:"createdBy,omitempty"`
}

// cleanEtcdPrefix is how an --etcd-prefix is compared: the storage backend joins keys
// under it as a path, so "/registry", "/registry/" and "registry" store at one place.
func cleanEtcdPrefix(p string) string { return path.Clean("/" + p) }

// EnsureIdentity returns the identity at <prefix>/cluster, creating it bound to
// resourcePrefix if absent (in one transaction: of two apiservers starting at once,
// one creates it and the other reads it). It refuses, naming both prefixes, when the
// identity is bound to another --etcd-prefix: this apiserver would otherwise join
// another cluster's coordination.
func EnsureIdentity(ctx context.Context, cli *clientv3.Client, prefix, resourcePrefix, createdBy string, now time.Time) (Identity, error) {
	key := coordination.Identity(prefix)
	want := Identity{ClusterID: rand.Text(), EtcdPrefix: cleanEtcdPrefix(resourcePrefix), CreatedAt: now.UTC(), CreatedBy: createdBy}
	data, err := json.Marshal(want)
	if err != nil {
		return Identity{}, err
	}
	resp, err := cli.Txn(ctx).
		If(clientv3.Compare(clientv3.CreateRevision(key), "=", 0)).
		Then(clientv3.OpPut(key, string(data))).
		Else(clientv3.OpGet(key)).
		Commit()
	if err != nil {
		return Identity{}, fmt.Errorf("reading or creating the cluster identity at %s: %w", key, err)
	}
	if resp.Succeeded {
		return want, nil
	}
	kvs := resp.Responses[0].GetResponseRange().Kvs
	if len(kvs) != 1 {
		return Identity{}, fmt.Errorf("the cluster identity at %s vanished while it was read; start again", key)
	}
	got, err := parseIdentity(key, kvs[0].Value)
	if err != nil {
		return Identity{}, err
	}
	if got.EtcdPrefix != want.EtcdPrefix {
		return Identity{}, fmt.Errorf("--coordination-prefix %s belongs to the cluster %s, which stores its objects under --etcd-prefix %q (%s); "+
			"this apiserver stores them under --etcd-prefix %q, so it is another cluster sharing this etcd: "+
			"give it its own --coordination-prefix (or leave the flag unset: the default derives one from --etcd-prefix), "+
			"or correct --etcd-prefix if this apiserver belongs to that cluster",
			prefix, got.ClusterID, got.EtcdPrefix, key, want.EtcdPrefix)
	}
	return got, nil
}

// readIdentity reads the identity at <prefix>/cluster at revision rev (0: the latest);
// nil when no apiserver has created one yet.
func readIdentity(ctx context.Context, cli *clientv3.Client, prefix string, rev int64) (*Identity, error) {
	key := coordination.Identity(prefix)
	var opts []clientv3.OpOption
	if rev > 0 {
		opts = append(opts, clientv3.WithRev(rev))
	}
	resp, err := cli.Get(ctx, key, opts...)
	if err != nil {
		return nil, fmt.Errorf("reading the cluster identity at %s: %w", key, err)
	}
	if len(resp.Kvs) == 0 {
		return nil, nil
	}
	id, err := parseIdentity(key, resp.Kvs[0].Value)
	if err != nil {
		return nil, err
	}
	return &id, nil
}

func parseIdentity(key string, value []byte) (Identity, error) {
	var id Identity
	if err := json.Unmarshal(value, &id); err != nil || id.ClusterID == "" || id.EtcdPrefix == "" {
		return Identity{}, fmt.Errorf("%s does not hold a cluster identity (clusterID and etcdPrefix); it is not rekey's, "+
			"or damaged: choose another --coordination-prefix, or delete the key when no apiserver coordinates under it", key)
	}
	return id, nil
}
