package storagelayout

import (
	"context"
	"fmt"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apimachinery/pkg/runtime/schema"
)

// AddStoredCRDs adds every custom resource whose CustomResourceDefinition is stored,
// at <group>/<plural> as the apiextensions server stores it. It reads keys only: a
// definition's name is <plural>.<group>, so its possibly encrypted value is never read.
func (l *Layout) AddStoredCRDs(ctx context.Context, cli *clientv3.Client) error {
	prefix := l.Locate(schema.GroupResource{Group: "apiextensions.k8s.io", Resource: "customresourcedefinitions"}).KeyPrefix
	from, end := prefix, clientv3.GetPrefixRangeEnd(prefix)
	for {
		resp, err := cli.Get(ctx, from, clientv3.WithRange(end), clientv3.WithKeysOnly(), clientv3.WithLimit(1000))
		if err != nil {
			return fmt.Errorf("listing the stored CustomResourceDefinitions under %s: %w", prefix, err)
		}
		for _, kv := range resp.Kvs {
			name := strings.TrimPrefix(string(kv.Key), prefix)
			plural, group, ok := strings.Cut(name, ".")
			if !ok || plural == "" || group == "" || strings.Contains(name, "/") {
				continue // not a definition's key; nothing to learn from it
			}
			if err := l.Add(schema.GroupResource{Group: group, Resource: plural}, group+"/"+plural); err != nil {
				return err
			}
		}
		if !resp.More || len(resp.Kvs) == 0 {
			return nil
		}
		from = string(resp.Kvs[len(resp.Kvs)-1].Key) + "\x00"
	}
}

// Stored lists the resources that hold at least one object under the etcd prefix, each
// once, in key order, all read at one etcd revision (returned). It is a skip scan: one
// keys-only request of one key per resource found, however many objects each holds, so
// it stays cheap at a million objects. Keys kube-apiserver writes without the resource
// transformers (Untransformed) and keys under skip (the coordination prefix, when it
// lies under the etcd prefix) are left out.
func (l *Layout) Stored(ctx context.Context, cli *clientv3.Client, skip ...string) ([]Location, int64, error) {
	root := l.etcdPrefix + "/"
	from, end := root, clientv3.GetPrefixRangeEnd(root)
	var rev int64
	var out []Location
	seen := map[string]bool{}
	for {
		opts := []clientv3.OpOption{clientv3.WithRange(end), clientv3.WithKeysOnly(), clientv3.WithLimit(1)}
		if rev != 0 {
			opts = append(opts, clientv3.WithRev(rev))
		}
		resp, err := cli.Get(ctx, from, opts...)
		if err != nil {
			return nil, 0, fmt.Errorf("scanning the stored resources under %s: %w", root, err)
		}
		if rev == 0 {
			rev = resp.Header.Revision
		}
		if len(resp.Kvs) == 0 {
			return out, rev, nil
		}
		key := string(resp.Kvs[0].Key)
		next := skipPast(key, root, skip)
		if next == "" {
			loc, ok := l.Owner(key)
			if !ok {
				// An untransformed directory: jump past all of it.
				rel, _ := l.relative(key)
				first, _, _ := strings.Cut(rel, "/")
				next = clientv3.GetPrefixRangeEnd(root + first + "/")
				if !strings.Contains(rel, "/") {
					next = key + "\x00"
				}
			} else {
				if !seen[loc.KeyPrefix] {
					seen[loc.KeyPrefix] = true
					out = append(out, loc)
				}
				next = clientv3.GetPrefixRangeEnd(loc.KeyPrefix)
			}
		}
		if next <= key {
			next = key + "\x00"
		}
		from = next
	}
}

// skipPast returns where to continue when key lies under one of skip, else "".
func skipPast(key, root string, skip []string) string {
	for _, s := range skip {
		s = strings.TrimSuffix(s, "/") + "/"
		if strings.HasPrefix(s, root) && strings.HasPrefix(key, s) {
			return clientv3.GetPrefixRangeEnd(s)
		}
	}
	return ""
}
