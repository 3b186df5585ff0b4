package migrate

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"sync"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// maxUnreadableSamples bounds how many keys of unreadable objects an inventory names.
const maxUnreadableSamples = 10

// compactedRetries bounds how often an inventory starts over because etcd compacted the
// revision it was reading at.
const compactedRetries = 3

// Inventory counts the stored objects of some resources per provider, key and staleness.
// It holds names, prefixes, counts and "sha256:" key id hashes, never key material.
type Inventory struct {
	// TakenAt is when the scan started; Duration how long it took.
	TakenAt  time.Time     `json:"takenAt"`
	Duration time.Duration `json:"duration"`
	// ConfigHash is the hash of the configuration the values were classified against.
	ConfigHash string `json:"configHash,omitempty"`
	// DecryptChecked is true when every value was also decrypted (Unreadable is exact):
	// by the scan, or, for the objects a verifying re-scan carried (Carried), by the
	// migration before it wrote them.
	DecryptChecked bool `json:"decryptChecked"`
	// Resources, in the order scanned.
	Resources []ResourceInventory `json:"resources"`
	// Wildcards are the wildcard rules ("*.*") whose every stored resource Resources
	// holds (Resolution.Wildcards): the guard may judge those rules by these counts.
	Wildcards []string `json:"wildcards,omitempty"`
}

// ResourceInventory is the inventory of one resource, read at one etcd revision.
type ResourceInventory struct {
	Resource  string `json:"resource"`
	KeyPrefix string `json:"keyPrefix"`
	// Guessed is true when KeyPrefix is only the custom-resource convention's guess
	// (Resource.Guessed): no object there proves nothing, so the guard does not take
	// this entry as the resource's count.
	Guessed  bool  `json:"keyPrefixGuessed,omitempty"`
	Revision int64 `json:"revision"`
	// WritePrefix and WriteKeyIDHash are what the resource was being written with when
	// it was scanned; a value not written with them is stale.
	WritePrefix    string `json:"writePrefix"`
	WriteKeyIDHash string `json:"writeKeyIDHash,omitempty"`
	Objects        int64  `json:"objects"`
	// Carried counts the objects of a migration's verifying re-scan that it did not
	// read again: still at the etcd revision of the migration's transaction that wrote
	// them, they hold what it wrote, which it had decrypted back before writing (see
	// ledger.go). They are counted in Objects and their buckets like any other.
	Carried int64 `json:"carried,omitempty"`
	// Stale counts readable objects not written with the write key: what a migration
	// rewrites. Unreadable objects are counted apart.
	Stale     int64 `json:"stale"`
	Plaintext int64 `json:"plaintext"`
	// Unreadable counts values the configuration cannot read: with a decrypt check,
	// every failed read; without, values whose prefix no provider of the rule has.
	Unreadable int64 `json:"unreadable"`
	// UnreadableKeys names up to ten of them (etcd keys, which are not secret).
	UnreadableKeys []string `json:"unreadableKeys,omitempty"`
	// UnreadableObjects describes the first MaxUnreadableListed of them.
	UnreadableObjects []UnreadableObject `json:"unreadableObjects,omitempty"`
	// Acknowledged is how many unreadable objects an operator acknowledged (for the
	// value stored now): they no longer keep a migration unverified or a key in use.
	Acknowledged int64   `json:"acknowledged,omitempty"`
	Buckets      []Count `json:"buckets"`
	// OtherBuckets is how many distinct buckets beyond the 64 listed besides the
	// configuration's own were counted in "other" buckets (Bucket.Other); exact up to
	// 10,000.
	OtherBuckets int64 `json:"otherBuckets,omitempty"`
}

// Count is the number of objects in one bucket.
type Count struct {
	Bucket
	Objects int64 `json:"objects"`
	// Unreadable is how many of them failed to decrypt (decrypt check only).
	Unreadable int64 `json:"unreadable,omitempty"`
	// Acknowledged is how many of the unreadable ones are acknowledged.
	Acknowledged int64 `json:"acknowledged,omitempty"`
	// Bytes is the total stored size.
	Bytes int64 `json:"bytes"`
	// SampleKey is the etcd key of one object of a KMS v2 bucket (one per bucket): the
	// decrypt guard proves with it that a new plugin still decrypts this key id's DEKs.
	SampleKey string `json:"-"`
}

// Find returns the inventory of resource r ("secrets"), or nil.
func (inv *Inventory) Find(r string) *ResourceInventory {
	if inv == nil {
		return nil
	}
	for i := range inv.Resources {
		if inv.Resources[i].Resource == r {
			return &inv.Resources[i]
		}
	}
	return nil
}

// TotalStale is the number of stale objects across all resources.
func (inv *Inventory) TotalStale() int64 {
	var n int64
	for _, r := range inv.Resources {
		n += r.Stale
	}
	return n
}

// TotalCarried is the number of objects a verifying re-scan counted from the
// migration's own writes without reading them (ResourceInventory.Carried).
func (inv *Inventory) TotalCarried() int64 {
	var n int64
	for _, r := range inv.Resources {
		n += r.Carried
	}
	return n
}

// TotalUnreadable is the number of unreadable objects across all resources.
func (inv *Inventory) TotalUnreadable() int64 {
	var n int64
	for _, r := range inv.Resources {
		n += r.Unreadable
	}
	return n
}

// TotalAcknowledged is the number of acknowledged unreadable objects across all resources.
func (inv *Inventory) TotalAcknowledged() int64 {
	var n int64
	for _, r := range inv.Resources {
		n += r.Acknowledged
	}
	return n
}

// Blocking is how many unreadable objects are not acknowledged: what keeps a migration
// unverified.
func (ri *ResourceInventory) Blocking() int64 { return ri.Unreadable - ri.Acknowledged }

// AllAcknowledged reports whether every object of the bucket is an acknowledged
// unreadable one: nothing readable is left under its key.
func (c Count) AllAcknowledged() bool { return c.Objects > 0 && c.Acknowledged == c.Objects }

// InventoryOptions configure TakeInventory.
type InventoryOptions struct {
	Client    *clientv3.Client
	Source    Source
	Resources []Resource
	// PageSize and PageBytes bound one etcd range request: objects (DefaultPageSize)
	// and bytes (DefaultPageBytes).
	PageSize  int64
	PageBytes int64
	// DecryptCheck decrypts every value with the current transformers: unreadable
	// values are found exactly and staleness is the transformers' own verdict.
	DecryptCheck bool
	// ConfigHash is recorded in the inventory.
	ConfigHash string
	// Wildcards are recorded in the inventory: the wildcard rules Resources is the whole
	// of (Resolution.Wildcards). Leave empty for a partial scan.
	Wildcards []string
	// CoordinationPrefix, when set, is where acknowledgements of unreadable objects are
	// read from (coordination.AcknowledgedPrefix); without it none is counted.
	CoordinationPrefix string
	// Revision, when set, reads every resource at this one etcd revision (evidence of
	// the whole store at one point); 0 reads each resource at the revision of its first
	// page. A compacted Revision is an error, not a retry.
	Revision int64
	// Workers decrypt in parallel (decrypt check only); default GOMAXPROCS.
	Workers int
	Clock   clock.PassiveClock
	Metrics *Metrics
	// readPacer, when set, paces the pages (a migration's verifying re-scan).
	readPacer *pace.ReadPacer
	// ledger, when set, is what the migration wrote (its verifying re-scan): objects
	// still as it wrote them are counted without reading their values (rescan.go).
	ledger *writeLedger
}

// TakeInventory scans every resource at one etcd revision each and counts its objects
// per bucket. Without DecryptCheck it never decrypts and never calls a KMS plugin.
func TakeInventory(ctx context.Context, opts InventoryOptions) (*Inventory, error) {
	if opts.Client == nil || opts.Source == nil {
		return nil, errors.New("migrate: inventory needs an etcd client and the transformers' source")
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Workers <= 0 {
		opts.Workers = runtime.GOMAXPROCS(0)
	}
	acks, err := loadAcknowledgements(ctx, opts.Client, opts.CoordinationPrefix)
	if err != nil {
		return nil, err
	}
	start := opts.Clock.Now()
	inv := &Inventory{TakenAt: start, ConfigHash: opts.ConfigHash, DecryptChecked: opts.DecryptCheck, Wildcards: opts.Wildcards}
	for _, res := range opts.Resources {
		var ri *ResourceInventory
		var err error
		for attempt := 0; ; attempt++ {
			ri, err = inventoryOf(ctx, opts, res, acks)
			if errors.Is(err, errCompacted) && opts.Revision == 0 && attempt < compactedRetries {
				continue
			}
			break
		}
		if err != nil {
			if errors.Is(err, errCompacted) && opts.Revision != 0 {
				return nil, fmt.Errorf("inventory of %s at revision %d: etcd compacted that revision; take the inventory again", res, opts.Revision)
			}
			return nil, fmt.Errorf("inventory of %s: %w", res, err)
		}
		inv.Resources = append(inv.Resources, *ri)
	}
	inv.Duration = opts.Clock.Since(start)
	opts.Metrics.recordInventory(inv)
	return inv, nil
}

// inventoryOf pages through res's key range at one revision and tallies every object;
// the pages are paced when opts.readPacer is set.
func inventoryOf(ctx context.Context, opts InventoryOptions, res Resource, acks Acknowledgements) (*ResourceInventory, error) {
	rule := opts.Source.Rule(res.GroupResource)
	cl := newClassifier(rule, opts.Source.KnownPrefixes())
	tr := opts.Source.TransformerFor(res.GroupResource)
	t := newTally(res, cl, acks, opts.DecryptCheck)
	if opts.readPacer != nil || opts.ledger != nil {
		total, header, err := countKeys(ctx, opts.Client, res)
		if err != nil {
			return nil, err
		}
		opts.readPacer.Resource(total)
		if ours, ok := opts.ledger.forScan(res.String(), cl, header); ok && opts.DecryptCheck {
			return rescanChanged(ctx, opts, res, tr, t, ours)
		}
	}
	p := newPager(opts.Client, res, "", opts.PageSize, true).withPageBytes(opts.PageBytes)
	p.rev = opts.Revision
	var results []checkResult
	err := readPages(ctx, opts, p, func(kvs []*mvccpb.KeyValue) (err error) {
		results, err = tallyValues(ctx, opts, tr, t, kvs, results)
		return err
	})
	if err != nil {
		return nil, err
	}
	return t.inventory(p.rev), nil
}

// readPages hands every page of p to handle, paced by opts.readPacer when set: each
// page is paid for before the next, reading and handling it included.
func readPages(ctx context.Context, opts InventoryOptions, p *pager, handle func([]*mvccpb.KeyValue) error) error {
	last := 0
	for {
		if err := opts.readPacer.Wait(ctx, last); err != nil {
			return err
		}
		start := opts.Clock.Now()
		kvs, err := p.page(ctx)
		if err != nil {
			return err
		}
		if len(kvs) == 0 {
			return nil
		}
		last = len(kvs)
		if err := handle(kvs); err != nil {
			return err
		}
		opts.readPacer.Read(opts.Clock.Since(start), len(kvs))
	}
}

// tallyValues decrypts kvs (with a decrypt check) and counts them; results is reused.
func tallyValues(ctx context.Context, opts InventoryOptions, tr value.Transformer, t *tally, kvs []*mvccpb.KeyValue, results []checkResult) ([]checkResult, error) {
	if opts.DecryptCheck {
		results = checkAll(ctx, tr, kvs, opts.Workers, results)
		for i, r := range results {
			if isTransient(r.err) {
				// A plugin outage is not unreadable data.
				return results, transient(kvs[i].Key, r.err)
			}
		}
	}
	for i, kv := range kvs {
		var check checkResult
		if opts.DecryptCheck {
			check = results[i]
		}
		t.add(kv, check)
	}
	return results, nil
}

type checkResult struct {
	stale bool
	err   error
}

// checkAll decrypts a page with workers goroutines; results[i] belongs to kvs[i].
func checkAll(ctx context.Context, tr value.Transformer, kvs []*mvccpb.KeyValue, workers int, results []checkResult) []checkResult {
	results = append(results[:0], make([]checkResult, len(kvs))...)
	_ = fanOut(len(kvs), workers, func(lo, hi int) error {
		for i := lo; i < hi; i++ {
			results[i] = checkOne(ctx, tr, kvs[i].Key, kvs[i].Value)
		}
		return nil
	})
	return results
}

// checkOne decrypts one stored value as the inventory's decrypt check does.
func checkOne(ctx context.Context, tr value.Transformer, key, stored []byte) checkResult {
	plain, stale, err := tr.TransformFromStorage(ctx, stored, value.DefaultContext(key))
	if err == nil && stale {
		// What a migration would refuse to rewrite is unreadable here too.
		err = checkStoredObject(plain)
	}
	return checkResult{stale: stale, err: err}
}

// InventoryStore holds the latest inventory for the guard, the status document and
// metrics. It is safe for concurrent use.
type InventoryStore struct {
	mu  sync.RWMutex
	inv *Inventory
	// asked: someone (the guard, refusing a change on this inventory's word) asked
	// for a fresh one.
	asked bool
}

// AskFresh asks the controller for a fresh inventory soon (within
// minAskedInventoryInterval of the last one): the guard calls it when it refuses a
// change on the latest inventory's word, so that a refusal is not repeated for the
// whole inventory interval on counts that may have changed since.
func (s *InventoryStore) AskFresh() {
	if s == nil {
		return
	}
	s.mu.Lock()
	s.asked = true
	s.mu.Unlock()
}

// takeAsk reports whether a fresh inventory was asked for since the last call.
func (s *InventoryStore) takeAsk() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	asked := s.asked
	s.asked = false
	return asked
}

// Set records inv as the latest inventory.
func (s *InventoryStore) Set(inv *Inventory) {
	s.mu.Lock()
	s.inv = inv
	s.mu.Unlock()
}

// Latest returns the latest inventory, or nil before the first one. Callers must not
// modify it.
func (s *InventoryStore) Latest() *Inventory {
	if s == nil {
		return nil
	}
	s.mu.RLock()
	defer s.mu.RUnlock()
	return s.inv
}
