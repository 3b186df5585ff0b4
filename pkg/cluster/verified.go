package cluster

// The leader's verifying re-scan, shared with the followers. Each apiserver keeps an
// inventory of what etcd holds (for its guard, its status document and its stale-object
// metrics), and a record of a verified migration newer than an apiserver's inventory
// made every follower read the resource again: in a 10,000-Secret rotation across three
// apiservers, the two followers read and classified every Secret at the same moment,
// right after the leader's re-scan had done the same, and the clients' requests in that
// second were the slowest of the rotation. So the leader writes its re-scan under
// <prefix>/migration/verified/<resource> before it records the migration verified, and a
// follower whose configuration is the one the re-scan classified against adopts it; any
// other follower (another configuration, no such key, one of another migration) reads
// the resource itself, as before.

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/migrate"
)

// verifiedInventory is one resource's verifying re-scan, as stored (JSON).
type verifiedInventory struct {
	TakenAt        time.Time     `json:"takenAt"`
	Duration       time.Duration `json:"duration"`
	ConfigHash     string        `json:"configHash"`
	DecryptChecked bool          `json:"decryptChecked"`
	// Resource holds the record's revision (ResourceInventory.Revision): a follower
	// adopts it only for the record of that revision.
	Resource migrate.ResourceInventory `json:"resource"`
	// SampleKeys are the buckets' sample keys (Count.SampleKey, etcd keys), in the
	// buckets' order: the inventory's own JSON leaves them out, and a follower's decrypt
	// guard needs them to prove a new KMS plugin still reads a key id.
	SampleKeys []string `json:"sampleKeys,omitempty"`
}

// publishVerified writes the re-scan of resource in inv while guard holds.
func publishVerified(cli *clientv3.Client, prefix, resource string, inv *migrate.Inventory, guard []clientv3.Cmp) error {
	ri := inv.Find(resource)
	if ri == nil {
		return fmt.Errorf("the verifying re-scan has no inventory of %s", resource)
	}
	v := verifiedInventory{TakenAt: inv.TakenAt, Duration: inv.Duration, ConfigHash: inv.ConfigHash, DecryptChecked: inv.DecryptChecked, Resource: *ri}
	v.SampleKeys = make([]string, len(ri.Buckets))
	for i, c := range ri.Buckets {
		v.SampleKeys[i] = c.SampleKey
	}
	data, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return guardedPut(cli, coordination.MigrationVerified(prefix, resource), data, guard)
}

// adoptVerified returns the leader's re-scan of resource when it is the one rec
// records (same revision) and was classified against configHash, this apiserver's
// configuration; false (and why) when this apiserver must read the resource itself.
func adoptVerified(ctx context.Context, cli *clientv3.Client, prefix, resource string, rec Record, configHash string) (*migrate.Inventory, string) {
	key := coordination.MigrationVerified(prefix, resource)
	ctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	resp, err := cli.Get(ctx, key)
	switch {
	case err != nil:
		return nil, fmt.Sprintf("reading %s: %v", key, err)
	case len(resp.Kvs) == 0:
		return nil, "the leader wrote no re-scan (the record came from its inventory, not a migration; or a leader of an older rekey; or its write failed)"
	}
	var v verifiedInventory
	if err := json.Unmarshal(resp.Kvs[0].Value, &v); err != nil {
		return nil, fmt.Sprintf("%s does not decode: %v", key, err)
	}
	switch {
	case v.Resource.Resource != resource || v.Resource.Revision != rec.Revision:
		return nil, fmt.Sprintf("the re-scan there is of revision %d, the record's is %d", v.Resource.Revision, rec.Revision)
	case configHash == "" || v.ConfigHash != configHash:
		return nil, "the re-scan was classified against another configuration"
	case len(v.SampleKeys) != 0 && len(v.SampleKeys) != len(v.Resource.Buckets):
		return nil, fmt.Sprintf("%s has %d sample keys for %d buckets", key, len(v.SampleKeys), len(v.Resource.Buckets))
	}
	ri := v.Resource
	ri.Buckets = append([]migrate.Count(nil), ri.Buckets...)
	for i := range v.SampleKeys {
		ri.Buckets[i].SampleKey = v.SampleKeys[i]
	}
	return &migrate.Inventory{TakenAt: v.TakenAt, Duration: v.Duration, ConfigHash: v.ConfigHash, DecryptChecked: v.DecryptChecked,
		Resources: []migrate.ResourceInventory{ri}}, ""
}
