package etcdsnapshot

import (
	"context"
	"fmt"
	"slices"
	"sort"
	"strings"

	"go.etcd.io/etcd/api/v3/mvccpb"
	"k8s.io/apimachinery/pkg/runtime/schema"

	"github.com/rekey-io/rekey/internal/etcdsnapshot/snapshotfile"
	"github.com/rekey-io/rekey/pkg/config"
	"github.com/rekey-io/rekey/pkg/guard"
	"github.com/rekey-io/rekey/pkg/keyledger"
	"github.com/rekey-io/rekey/pkg/migrate"
	"github.com/rekey-io/rekey/pkg/storagelayout"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// Options say where a snapshot's objects and key ledger are.
type Options struct {
	// Layout maps stored keys to resources (storagelayout.Kube for --etcd-prefix).
	Layout *storagelayout.Layout
	// CoordinationPrefix is where the apiservers kept the key ledger.
	CoordinationPrefix string
	// Read says how the file is read: hash check, reader process.
	Read snapshotfile.Options
}

// Report is what a snapshot's objects need.
type Report struct {
	// Revision is the snapshot's latest revision.
	Revision int64 `json:"revision"`
	// Resources, sorted by name.
	Resources []Resource `json:"resources"`
	// Ledger is the key ledger the snapshot holds, nil when it holds none (taken before
	// the apiservers kept one).
	Ledger *keyledger.Ledger `json:"ledger,omitempty"`
}

// Resource counts one resource's objects per stored key.
type Resource struct {
	Resource  string `json:"resource"`
	KeyPrefix string `json:"keyPrefix"`
	// Guessed: the layout does not know the resource; its name is the key's shape.
	Guessed bool     `json:"keyPrefixGuessed,omitempty"`
	Objects int64    `json:"objects"`
	Buckets []Bucket `json:"buckets"`
}

// Bucket is the objects of one resource under one stored prefix (and KMS v2 key id).
type Bucket struct {
	// Provider, Key, Prefix and KeyIDHash: as migrate.Bucket.
	Provider  string `json:"provider"`
	Key       string `json:"key,omitempty"`
	Prefix    string `json:"prefix"`
	KeyIDHash string `json:"keyIDHash,omitempty"`
	Objects   int64  `json:"objects"`
	// Checks are the check values the snapshot's ledger knows for this key name (local
	// keys): the secrets values under this prefix were written with.
	Checks []string `json:"checks,omitempty"`
	// NoCheckValue: a local key (aesgcm, aescbc, secretbox) of which the snapshot's
	// ledger knows no check value (no ledger, or none for this name), so nothing tells
	// which secret of that name its values need.
	NoCheckValue bool `json:"noCheckValueKnown,omitempty"`
}

// Key names the bucket's key the way an error names it.
func (b Bucket) String() string {
	s := b.Provider
	if b.Key != "" {
		s += " " + b.Key
	}
	if b.KeyIDHash != "" {
		s += " (key id " + b.KeyIDHash + ")"
	}
	if len(b.Checks) > 0 {
		s += " (check " + strings.Join(b.Checks, " or ") + ")"
	}
	if b.NoCheckValue {
		s += " (no check value known)"
	}
	return s
}

// localKey reports whether provider's keys are secrets in the configuration, told
// apart by check value; a KMS provider's key is the plugin's.
func localKey(provider string) bool {
	switch provider {
	case transformers.ProviderAESGCM, transformers.ProviderAESCBC, transformers.ProviderSecretbox:
		return true
	}
	return false
}

// Inventory reads the snapshot at path: every live key under the layout's etcd
// prefix, by resource and stored prefix, and the key ledger. A file that is not an
// intact snapshot gives a *snapshotfile.CorruptError.
func Inventory(ctx context.Context, path string, o Options) (*Report, error) {
	if o.Layout == nil {
		o.Layout = storagelayout.Kube(storagelayout.DefaultEtcdPrefix)
	}
	rep := &Report{}
	type bucketKey struct{ resource, prefix, keyIDHash string }
	counts := map[bucketKey]*Bucket{}
	resources := map[string]*Resource{}
	ledgerKey := keyledger.Key(o.CoordinationPrefix)
	var ledgerErr error
	rev, err := Latest(ctx, path, o.Read, func(kv *mvccpb.KeyValue) error {
		key := string(kv.Key)
		if o.CoordinationPrefix != "" && key == ledgerKey {
			rep.Ledger, ledgerErr = keyledger.Decode(kv.Value)
			return nil
		}
		loc, ok := o.Layout.Owner(key)
		if !ok {
			return nil // outside the etcd prefix, or never encrypted
		}
		name := config.GroupResourceString(loc.GroupResource)
		r := resources[name]
		if r == nil {
			r = &Resource{Resource: name, KeyPrefix: loc.KeyPrefix, Guessed: loc.Guessed}
			resources[name] = r
		}
		r.Objects++
		b := migrate.ClassifyValue(kv.Value)
		bk := bucketKey{name, b.Prefix, b.KeyIDHash}
		if counts[bk] == nil {
			counts[bk] = &Bucket{Provider: b.Provider, Key: b.Key, Prefix: b.Prefix, KeyIDHash: b.KeyIDHash}
		}
		counts[bk].Objects++
		return nil
	})
	if err != nil {
		return nil, err
	}
	if ledgerErr != nil {
		return nil, fmt.Errorf("the key ledger %s in snapshot %s: %w", ledgerKey, path, ledgerErr)
	}
	rep.Revision = rev
	for bk, b := range counts {
		for _, e := range rep.Ledger.Named(b.Provider, b.Key) {
			if e.Check != "" && !slices.Contains(b.Checks, e.Check) {
				b.Checks = append(b.Checks, e.Check)
			}
		}
		sort.Strings(b.Checks)
		b.NoCheckValue = localKey(b.Provider) && len(b.Checks) == 0
		resources[bk.resource].Buckets = append(resources[bk.resource].Buckets, *b)
	}
	for _, r := range resources {
		sort.Slice(r.Buckets, func(i, j int) bool {
			if r.Buckets[i].Prefix != r.Buckets[j].Prefix {
				return r.Buckets[i].Prefix < r.Buckets[j].Prefix
			}
			return r.Buckets[i].KeyIDHash < r.Buckets[j].KeyIDHash
		})
		rep.Resources = append(rep.Resources, *r)
	}
	sort.Slice(rep.Resources, func(i, j int) bool { return rep.Resources[i].Resource < rep.Resources[j].Resource })
	return rep, nil
}

// Finding is a bucket of a snapshot a configuration cannot read, or cannot be shown to
// read.
type Finding struct {
	Resource string `json:"resource"`
	Bucket   Bucket `json:"bucket"`
	Reason   string `json:"reason"`
}

func (u Finding) String() string {
	return fmt.Sprintf("%s: %d objects under %s: %s", u.Resource, u.Bucket.Objects, u.Bucket, u.Reason)
}

// Check sorts the buckets of rep that cfg may not read. Every bucket must be readable
// by a provider of its resource's rule. A local key must be the secret the snapshot's
// ledger says its values were written with, by check value: one of another check value
// is unreadable; where the ledger knows no check value for the key (no ledger, or none
// for that name), a key of the same name proves nothing, and the bucket is unverified
// ("no check value known"), not readable. A KMS v2 bucket is readable by a provider of
// its name; which key ids the plugin decrypts only the plugin knows, so the key id is
// named.
func Check(rep *Report, cfg *config.Config) (unreadable, unverified []Finding) {
	rules, _ := transformers.ByResource(guard.ConfigKeys(cfg))
	for _, r := range rep.Resources {
		chain, ok := transformers.Lookup(rules, schema.ParseGroupResource(r.Resource))
		if !ok {
			chain = transformers.NoRule(r.Resource).ReadKeys
		}
		for _, b := range r.Buckets {
			reason, verified := readable(chain, b)
			switch {
			case reason != "" && !verified:
				unverified = append(unverified, Finding{Resource: r.Resource, Bucket: b, Reason: reason})
			case reason != "":
				unreadable = append(unreadable, Finding{Resource: r.Resource, Bucket: b, Reason: reason})
			}
		}
	}
	return unreadable, unverified
}

// readable says why chain cannot read b ("" when it can). verified is false when it
// cannot be told: reason then says why.
func readable(chain []transformers.KeyInfo, b Bucket) (reason string, verified bool) {
	var named []transformers.KeyInfo
	for _, k := range chain {
		if k.Provider == b.Provider && k.Key == b.Key {
			named = append(named, k)
		}
	}
	if len(named) == 0 {
		if b.Provider == transformers.ProviderIdentity {
			return "they are plaintext and the resource's rule has no identity provider", true
		}
		return "the resource's rule has no such key: add it as a read key (not first) from the configuration that wrote them", true
	}
	if !localKey(b.Provider) {
		return "", true // identity, or a KMS provider of that name: the plugin holds the key
	}
	if len(b.Checks) == 0 {
		return fmt.Sprintf("no check value known: the snapshot's key ledger records none for this key, so nothing tells whether the configuration's key of that name (check %s) is the secret they were written with", named[0].Check), false
	}
	for _, k := range named {
		if slices.Contains(b.Checks, k.Check) {
			return "", true
		}
	}
	return fmt.Sprintf("the configuration's key of that name has check %s, another secret than the one the snapshot's key ledger says they were written with: restore that key", named[0].Check), true
}
