package guard

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strings"

	clientv3 "go.etcd.io/etcd/client/v3"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"

	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// DecryptFailure is one KMS v2 bucket of stored objects that a new configuration's
// provider of the same name could not decrypt a sample of.
type DecryptFailure struct {
	Resource string
	// Provider is the KMS provider name; KeyIDHash the key id as "sha256:<hex>".
	Provider  string
	KeyIDHash string
	// Objects is the inventory's count of objects under this key id.
	Objects int64
	// Unavailable is true when the plugin did not answer (gRPC Unavailable or
	// DeadlineExceeded): nothing is known about its keyring.
	Unavailable bool
	// Err is the read error. String shows only its gRPC code when the plugin answered:
	// a plugin's own message may name raw key ids.
	Err error
}

// Reason describes f.Err without the plugin's own words (they may name raw key ids).
func (f DecryptFailure) Reason() string {
	var se interface{ GRPCStatus() *status.Status }
	if errors.As(f.Err, &se) {
		return "the plugin answered " + se.GRPCStatus().Code().String()
	}
	return f.Err.Error()
}

func (f DecryptFailure) String() string {
	if f.Unavailable {
		return fmt.Sprintf("%s: %d objects are stored under kms provider %q key id %s; the new plugin for it is unavailable, so whether it can decrypt them is unknown (%s)", f.Resource, f.Objects, f.Provider, f.KeyIDHash, f.Reason())
	}
	return fmt.Sprintf("%s: %d objects are stored under kms provider %q key id %s, and the new plugin for it cannot decrypt them (%s)", f.Resource, f.Objects, f.Provider, f.KeyIDHash, f.Reason())
}

// DecryptOptions configure NewDecrypt.
type DecryptOptions struct {
	// Inventory supplies the KMS v2 buckets and their sample keys.
	Inventory *migrate.InventoryStore
	// Client returns the etcd client to read samples with; nil (or a nil client) skips
	// the check.
	Client func() *clientv3.Client
	// Override lets a failing change through (logged).
	Override func() bool
	Metrics  *Metrics
	Logger   klog.Logger
}

// NewDecrypt returns a reload guard for a built, health-gated, not yet serving
// Set (reload.Options.SetGuard). CheckChange counts a KMS v2 provider as kept while
// the next configuration has one of the same name, since a plugin's keyring cannot be
// seen in the configuration; this guard closes that gap: for every (provider, key id)
// bucket the latest inventory knows under a provider the next configuration keeps, it
// reads the bucket's sample object from etcd and decrypts it with the new Set. One
// plugin call per key id, bounded by the inventory's buckets.
func NewDecrypt(o DecryptOptions) func(ctx context.Context, current, next *config.Config, set *transformers.Set) error {
	if o.Logger.GetSink() == nil {
		o.Logger = klog.Background()
	}
	return func(ctx context.Context, _, next *config.Config, set *transformers.Set) error {
		var cli *clientv3.Client
		if o.Client != nil {
			cli = o.Client()
		}
		if cli == nil {
			return nil
		}
		fs, err := CheckDecrypt(ctx, o.Inventory.Latest(), cli, next, setTransformers{set})
		if err != nil {
			return err
		}
		if len(fs) == 0 {
			return nil
		}
		derr := &RefusedError{Check: Decrypt, Next: ConfigName(next), Failures: fs}
		if o.Override != nil && o.Override() {
			o.Logger.Info("Allowing a configuration whose kms plugin cannot decrypt stored data, because the override is set", "config", next.Source, "hash", next.Hash, "failures", len(fs), "detail", derr.Error())
			return nil
		}
		return o.Metrics.Count(derr)
	}
}

// CheckDecrypt decrypts, with tr (serving next), one sample object per KMS v2
// (provider, key id) bucket of inv whose provider next still has for the resource, and
// lists the buckets it failed on. An error means etcd could not be read.
func CheckDecrypt(ctx context.Context, inv *migrate.Inventory, cli *clientv3.Client, next *config.Config, tr value.ResourceTransformers) ([]DecryptFailure, error) {
	if inv == nil {
		return nil, nil
	}
	nxt := newChains(next)
	type bucketID struct{ prefix, keyID string }
	type sample struct {
		gr  schema.GroupResource
		key string
	}
	type resourceBucket struct {
		resource string
		id       bucketID
	}
	samples := map[bucketID]sample{}
	counts := map[resourceBucket]int64{}
	var order []resourceBucket
	for _, ri := range inv.Resources {
		gr := schema.ParseGroupResource(ri.Resource)
		nc := nxt.lookup(gr)
		for _, c := range ri.Buckets {
			if c.Provider != transformers.ProviderKMSv2 || c.KeyIDHash == "" || c.Objects == 0 || !nc.canRead(c.Prefix) {
				continue // not KMS v2, or dropped: CheckChange reports a dropped provider
			}
			if c.AllAcknowledged() {
				continue // nothing under this key id is meant to be read again
			}
			id := bucketID{c.Prefix, c.KeyIDHash}
			if _, ok := samples[id]; !ok && c.SampleKey != "" {
				samples[id] = sample{gr: gr, key: c.SampleKey}
			}
			rb := resourceBucket{ri.Resource, id}
			if _, ok := counts[rb]; !ok {
				order = append(order, rb)
			}
			counts[rb] += c.Objects - c.Acknowledged
		}
	}
	failed := map[bucketID]error{}
	for id, s := range samples {
		resp, err := cli.Get(ctx, s.key)
		if err != nil {
			return nil, fmt.Errorf("reading sample object %q for the kms decrypt check: %w", s.key, err)
		}
		if len(resp.Kvs) == 0 || !strings.HasPrefix(string(resp.Kvs[0].Value), id.prefix) {
			continue // deleted or rewritten since the inventory; the next one samples anew
		}
		kv := resp.Kvs[0]
		if _, _, err := tr.TransformerForResource(s.gr).TransformFromStorage(ctx, kv.Value, value.DefaultContext(kv.Key)); err != nil {
			failed[id] = err
		}
	}
	var out []DecryptFailure
	for _, rb := range order {
		err, ok := failed[rb.id]
		if !ok {
			continue
		}
		_, name := transformers.SplitPrefix(rb.id.prefix)
		out = append(out, DecryptFailure{Resource: rb.resource, Provider: name, KeyIDHash: rb.id.keyID, Objects: counts[rb], Unavailable: transformers.PluginUnreachable(err), Err: err})
	}
	sort.SliceStable(out, func(i, j int) bool { return out[i].Resource < out[j].Resource })
	return out, nil
}

// setTransformers serves a built Set as value.ResourceTransformers.
type setTransformers struct{ s *transformers.Set }

func (t setTransformers) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return t.s.TransformerFor(gr)
}
