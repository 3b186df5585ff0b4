package migrate

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"golang.org/x/time/rate"
	"k8s.io/apiserver/pkg/storage/value"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"
)

// Defaults of a migration.
const (
	// DefaultBatchSize is how many rewrites share one etcd transaction (etcd allows
	// 128 operations per transaction by default).
	DefaultBatchSize = 64
	// DefaultBatchBytes bounds the size of one transaction (etcd's default request
	// limit is 1.5 MiB).
	DefaultBatchBytes = 1 << 20
	// DefaultMaxPasses bounds migrate-and-verify rounds.
	DefaultMaxPasses = 3
	// maxConflictRetries bounds how often one object is re-read after a concurrent
	// change before the migration gives up on it (and fails verification).
	maxConflictRetries = 10
	// checkpointEvery bounds how often the checkpoint file is rewritten.
	checkpointEvery = 250 * time.Millisecond
)

// Options configure Migrate.
type Options struct {
	Client    *clientv3.Client
	Source    Source
	Resources []Resource
	// Rate limits rewrites to this many objects per second; 0 means unlimited.
	Rate float64
	// PageSize and PageBytes bound one etcd range request: objects (DefaultPageSize)
	// and bytes (DefaultPageBytes; see there how the byte bound is kept).
	PageSize  int64
	PageBytes int64
	// BatchSize and BatchBytes bound one etcd transaction.
	BatchSize  int
	BatchBytes int
	// Workers re-encrypt and write in parallel; default 2 × GOMAXPROCS.
	Workers int
	// CheckpointPath, when set, records progress there so a stopped migration can be
	// resumed.
	CheckpointPath string
	// Checkpoints, when set, is used instead of CheckpointPath (e.g. a store in etcd).
	Checkpoints CheckpointStore
	// Resume continues from CheckpointPath. Without it an unfinished checkpoint is an
	// error, so two runs never silently disagree about progress.
	Resume bool
	// MaxPasses bounds migrate-and-verify rounds (objects can turn stale again while a
	// pass runs, e.g. written by an apiserver still on an older configuration).
	MaxPasses int
	// Progress is called after every handled page and at each phase change.
	Progress func(Progress)
	// Metrics, when set, records migration and inventory metrics.
	Metrics *Metrics
	// Inventory, when set, receives the verifying re-scan.
	Inventory *InventoryStore
	// ConfigHash is recorded in the verifying inventory.
	ConfigHash string
	Logger     klog.Logger
	Clock      clock.PassiveClock
}

// Counters count what a migration did to objects.
type Counters struct {
	// Scanned objects were read from etcd.
	Scanned int64 `json:"scanned"`
	// Rewritten objects were re-encrypted with the write key.
	Rewritten int64 `json:"rewritten"`
	// Current objects were already on the write key.
	Current int64 `json:"current"`
	// Conflicts counts compare-and-swap failures (a concurrent write won; the object was
	// re-read and, if still stale, rewritten from its new value).
	Conflicts int64 `json:"conflicts"`
	// Gone objects were deleted while the migration ran.
	Gone int64 `json:"gone"`
	// Unreadable objects could not be decrypted, or decrypted to something that is not a
	// stored Kubernetes object, and were left unchanged.
	Unreadable int64 `json:"unreadable"`
}

// Progress is a snapshot of a running migration.
type Progress struct {
	// Phase is "migrate" or "verify".
	Phase    string
	Pass     int
	Resource string
	// Total is the resource's object count when its pass started (an estimate).
	Total int64
	// Done is how many of its objects this pass handled.
	Done int64
	// Counters are for the whole run.
	Counters
	Elapsed time.Duration
}

// Result is the outcome of a migration.
type Result struct {
	Passes int
	Counters
	Duration time.Duration
	// Verified is the final re-scan (with decrypt check).
	Verified *Inventory
}

// ErrNotFinished reports that a verifying re-scan still found stale or unreadable
// objects after the last pass.
var ErrNotFinished = errors.New("storage migration not finished")

type counters struct {
	scanned, rewritten, current, conflicts, gone, unreadable atomic.Int64
}

func (c *counters) snapshot() Counters {
	return Counters{
		Scanned: c.scanned.Load(), Rewritten: c.rewritten.Load(), Current: c.current.Load(),
		Conflicts: c.conflicts.Load(), Gone: c.gone.Load(), Unreadable: c.unreadable.Load(),
	}
}

func (c *counters) restore(s Counters) {
	c.scanned.Store(s.Scanned)
	c.rewritten.Store(s.Rewritten)
	c.current.Store(s.Current)
	c.conflicts.Store(s.Conflicts)
	c.gone.Store(s.Gone)
	c.unreadable.Store(s.Unreadable)
}

type migrator struct {
	opts    Options
	log     klog.Logger
	limiter *rate.Limiter
	start   time.Time
	c       counters

	ckpt          *Checkpoint
	lastCkptWrite time.Time
}

// Migrate rewrites every stale object of opts.Resources through the current
// transformers, then re-scans with a decrypt check; it returns nil only when that
// re-scan finds no stale and no unreadable object.
//
// Each rewrite is a compare-and-swap on the object's etcd ModRevision: a concurrent
// update always wins, and the object is then re-read and rewritten from its new value
// only if it is still stale. The plaintext is never changed, so a rewrite is a pure
// re-encryption; watchers see a MODIFIED event with a new resourceVersion, exactly as
// after `kubectl replace` of the unchanged object.
func Migrate(ctx context.Context, opts Options) (*Result, error) {
	if opts.Client == nil || opts.Source == nil {
		return nil, errors.New("migrate: a migration needs an etcd client and the transformers' source")
	}
	if len(opts.Resources) == 0 {
		return nil, errors.New("migrate: no resources to migrate")
	}
	if opts.Clock == nil {
		opts.Clock = clock.RealClock{}
	}
	if opts.Logger.GetSink() == nil {
		opts.Logger = klog.Background()
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = DefaultBatchSize
	}
	if opts.BatchBytes <= 0 {
		opts.BatchBytes = DefaultBatchBytes
	}
	if opts.Workers <= 0 {
		opts.Workers = 2 * runtime.GOMAXPROCS(0)
	}
	if opts.MaxPasses <= 0 {
		opts.MaxPasses = DefaultMaxPasses
	}
	m := &migrator{opts: opts, log: opts.Logger.WithName("storage-migration"), start: opts.Clock.Now()}
	if opts.Rate > 0 {
		if float64(opts.BatchSize) > opts.Rate {
			m.opts.BatchSize = max(1, int(opts.Rate))
		}
		m.limiter = rate.NewLimiter(rate.Limit(opts.Rate), m.opts.BatchSize)
	}
	opts.Metrics.setRunning(true)
	defer opts.Metrics.setRunning(false)
	res, err := m.run(ctx)
	opts.Metrics.migrationDone(err, float64(opts.Clock.Now().UnixNano())/1e9)
	return res, err
}

func (m *migrator) targets() map[string]writeTarget {
	t := map[string]writeTarget{}
	for _, r := range m.opts.Resources {
		t[r.String()] = targetOf(m.opts.Source.Rule(r.GroupResource))
	}
	return t
}

func (m *migrator) run(ctx context.Context) (*Result, error) {
	if err := m.loadCheckpoint(); err != nil {
		return nil, err
	}
	res := &Result{}
	for pass := 1; pass <= m.opts.MaxPasses; pass++ {
		res.Passes = pass
		if !m.ckpt.Completed {
			for _, r := range m.opts.Resources {
				if pass == 1 && m.ckpt.isDone(r.String()) {
					continue
				}
				from := ""
				if pass == 1 && m.ckpt.Resource == r.String() && m.ckpt.LastKey != "" {
					from = m.ckpt.LastKey + "\x00"
					m.log.Info("Resuming storage migration from checkpoint", "resource", r.String(), "after", m.ckpt.LastKey)
				}
				if err := m.migrateResource(ctx, pass, r, from); err != nil {
					m.saveCheckpoint(true)
					return m.result(res), err
				}
			}
		}
		m.progress(Progress{Phase: "verify", Pass: pass})
		inv, err := TakeInventory(ctx, InventoryOptions{
			Client: m.opts.Client, Source: m.opts.Source, Resources: m.opts.Resources,
			PageSize: m.opts.PageSize, PageBytes: m.opts.PageBytes, DecryptCheck: true, ConfigHash: m.opts.ConfigHash,
			Clock: m.opts.Clock, Metrics: m.opts.Metrics,
		})
		if err != nil {
			return m.result(res), fmt.Errorf("verifying re-scan: %w", err)
		}
		m.opts.Inventory.setIfNotNil(inv)
		res.Verified = inv
		stale, unreadable := inv.TotalStale(), inv.TotalUnreadable()
		if stale == 0 && unreadable == 0 {
			m.ckpt.Completed = true
			m.saveCheckpoint(true)
			m.log.Info("Storage migration verified: no stale object left", "passes", pass, "rewritten", m.c.rewritten.Load(), "duration", m.opts.Clock.Since(m.start))
			return m.result(res), nil
		}
		if unreadable > 0 {
			return m.result(res), fmt.Errorf("%w: %d objects cannot be decrypted with the current configuration, or decrypt to something that is not a Kubernetes object (%s), and were left unchanged; restore the key they need or delete them, then run the migration again", ErrNotFinished, unreadable, unreadableSample(inv))
		}
		m.log.Info("Verifying re-scan still found stale objects; starting another pass", "stale", stale, "pass", pass)
		m.ckpt = &Checkpoint{Targets: m.targets(), Counters: m.c.snapshot()}
	}
	inv := res.Verified
	return m.result(res), fmt.Errorf("%w: %d objects are still stale after %d passes (%s); something keeps writing with an older key — check that every apiserver runs the new configuration (its status document shows the active config hash), then run the migration again", ErrNotFinished, inv.TotalStale(), m.opts.MaxPasses, staleSample(inv))
}

func (m *migrator) result(r *Result) *Result {
	r.Counters = m.c.snapshot()
	r.Duration = m.opts.Clock.Since(m.start)
	return r
}

func (s *InventoryStore) setIfNotNil(inv *Inventory) {
	if s != nil {
		s.Set(inv)
	}
}

func unreadableSample(inv *Inventory) string {
	var parts []string
	for _, r := range inv.Resources {
		if r.Unreadable > 0 {
			parts = append(parts, fmt.Sprintf("%s: %d, e.g. %s", r.Resource, r.Unreadable, strings.Join(r.UnreadableKeys, ", ")))
		}
	}
	return strings.Join(parts, "; ")
}

func staleSample(inv *Inventory) string {
	var parts []string
	for _, r := range inv.Resources {
		for _, b := range r.Buckets {
			if b.Stale && b.Objects > 0 {
				parts = append(parts, fmt.Sprintf("%s: %d under %s", r.Resource, b.Objects, describeBucket(b.Bucket)))
			}
		}
	}
	return strings.Join(parts, "; ")
}

func describeBucket(b Bucket) string {
	if b.Other {
		return fmt.Sprintf("%s values under further keys or key ids (an inventory lists at most %d distinct buckets per resource)", b.Provider, MaxBucketsPerResource)
	}
	switch b.Provider {
	case ProviderIdentity:
		return "plaintext (identity)"
	case ProviderKMSv2:
		if b.KeyIDHash != "" {
			return fmt.Sprintf("kms provider %q key id %s", b.Key, b.KeyIDHash)
		}
		return fmt.Sprintf("kms provider %q (undecodable EncryptedObject)", b.Key)
	}
	if b.Key == "" {
		return fmt.Sprintf("%s with an unreadable key name (prefix %q)", b.Provider, b.Prefix)
	}
	return fmt.Sprintf("%s key %q", b.Provider, b.Key)
}

// ---- checkpoint handling ----

func (m *migrator) loadCheckpoint() error {
	targets := m.targets()
	m.ckpt = &Checkpoint{Targets: targets}
	store := m.checkpoints()
	if store == nil {
		return nil
	}
	path := store.String()
	old, err := store.Load()
	if err != nil {
		return err
	}
	switch {
	case old == nil:
		if m.opts.Resume {
			m.log.Info("No migration checkpoint to resume from; starting from the beginning", "path", path)
		}
	case !m.opts.Resume && !old.Completed:
		return fmt.Errorf("an unfinished migration checkpoint exists at %q (last key %q); pass --resume to continue it, or delete the file to start over", path, old.LastKey)
	case !m.opts.Resume:
		// A finished checkpoint of an earlier run: start a new migration.
	case !sameTargets(old.Targets, targets):
		m.log.Info("The write keys changed since the checkpoint was written; starting the migration from the beginning", "path", path)
	default:
		old.Completed = false // a resumed run always ends with its own re-scan
		m.ckpt = old
		m.c.restore(old.Counters)
	}
	m.saveCheckpoint(true)
	return nil
}

func (m *migrator) saveCheckpoint(force bool) {
	store := m.checkpoints()
	if store == nil {
		return
	}
	now := m.opts.Clock.Now()
	if !force && now.Sub(m.lastCkptWrite) < checkpointEvery {
		return
	}
	m.lastCkptWrite = now
	m.ckpt.Counters = m.c.snapshot()
	m.ckpt.UpdatedAt = now
	if err := store.Save(m.ckpt); err != nil {
		// Progress is only lost, never corrupted: a resume re-checks every object.
		m.log.Error(err, "Could not save the migration checkpoint; a resumed migration will re-check more objects")
	}
}

func (m *migrator) progress(p Progress) {
	if m.opts.Progress == nil {
		return
	}
	p.Counters = m.c.snapshot()
	p.Elapsed = m.opts.Clock.Since(m.start)
	m.opts.Progress(p)
}

// ---- one resource ----

func (m *migrator) migrateResource(ctx context.Context, pass int, r Resource, from string) error {
	name := r.String()
	total, err := countKeys(ctx, m.opts.Client, r)
	if err != nil {
		return err
	}
	m.ckpt.Resource, m.ckpt.LastKey = name, ""
	if from != "" {
		m.ckpt.LastKey = strings.TrimSuffix(from, "\x00")
	}
	tr := m.opts.Source.TransformerFor(r.GroupResource)
	// Pages are read at the latest revision: the compare-and-swap on every write is
	// what keeps a rewrite safe, and a long migration must survive the apiserver's
	// periodic compaction.
	p := newPager(m.opts.Client, r, from, m.opts.PageSize, false).withPageBytes(m.opts.PageBytes)

	// Unbuffered: the fetcher holds at most one page (the next) while one is handled.
	pages := make(chan []*mvccpb.KeyValue)
	fetchErr := make(chan error, 1)
	fetchCtx, cancelFetch := context.WithCancel(ctx)
	defer cancelFetch()
	go func() {
		defer close(pages)
		for {
			kvs, err := p.page(fetchCtx)
			if err != nil {
				fetchErr <- err
				return
			}
			if len(kvs) == 0 {
				return
			}
			select {
			case pages <- kvs:
			case <-fetchCtx.Done():
				return
			}
		}
	}()

	var done int64
	m.progress(Progress{Phase: "migrate", Pass: pass, Resource: name, Total: total})
	for kvs := range pages {
		if err := m.handlePage(ctx, tr, name, kvs); err != nil {
			return err
		}
		done += int64(len(kvs))
		m.ckpt.LastKey = string(kvs[len(kvs)-1].Key)
		m.saveCheckpoint(false)
		m.opts.Metrics.setRemaining(name, total-done)
		m.progress(Progress{Phase: "migrate", Pass: pass, Resource: name, Total: total, Done: done})
	}
	if err := ctx.Err(); err != nil {
		return err
	}
	select {
	case err := <-fetchErr:
		return fmt.Errorf("migrating %s: %w", name, err)
	default:
	}
	m.ckpt.Done = append(m.ckpt.Done, name)
	m.ckpt.Resource, m.ckpt.LastKey = "", ""
	m.saveCheckpoint(true)
	m.opts.Metrics.setRemaining(name, 0)
	return nil
}

// handlePage re-encrypts the stale objects of one page with the workers and returns
// when every object of the page is handled (so the checkpoint may move past it).
func (m *migrator) handlePage(ctx context.Context, tr value.Transformer, resource string, kvs []*mvccpb.KeyValue) error {
	workers := min(m.opts.Workers, (len(kvs)+m.opts.BatchSize-1)/m.opts.BatchSize)
	workers = max(workers, 1)
	chunk := (len(kvs) + workers - 1) / workers
	errs := make([]error, workers)
	var wg sync.WaitGroup
	for w := 0; w < workers; w++ {
		lo, hi := w*chunk, min((w+1)*chunk, len(kvs))
		if lo >= hi {
			break
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[w] = m.handleChunk(ctx, tr, resource, kvs[lo:hi])
		}()
	}
	wg.Wait()
	return errors.Join(errs...)
}

// rewrite is one object to be swapped: its new value and what it must still be.
type rewrite struct {
	key    []byte
	val    []byte
	modRev int64
	lease  int64
}

func (m *migrator) handleChunk(ctx context.Context, tr value.Transformer, resource string, kvs []*mvccpb.KeyValue) error {
	var batch []rewrite
	size := 0
	flush := func() error {
		if len(batch) == 0 {
			return nil
		}
		err := m.commit(ctx, tr, resource, batch)
		batch, size = batch[:0], 0
		return err
	}
	for _, kv := range kvs {
		if err := ctx.Err(); err != nil {
			return err
		}
		m.c.scanned.Add(1)
		rw, result, err := m.prepare(ctx, tr, kv)
		if err != nil {
			return err
		}
		if result != "" {
			m.count(resource, result)
			continue
		}
		if size+len(rw.val)+len(rw.key) > m.opts.BatchBytes {
			if err := flush(); err != nil {
				return err
			}
		}
		batch = append(batch, rw)
		size += len(rw.val) + len(rw.key)
		if len(batch) >= m.opts.BatchSize {
			if err := flush(); err != nil {
				return err
			}
		}
	}
	return flush()
}

// prepare decides about one stored value: a rewrite when it is stale, else the result
// to count (current or unreadable). A stale value is rewritten only if it decrypted to
// a stored Kubernetes object (checkStoredObject): anything else is counted unreadable
// and left as it is, so a wrong-key read can never be made permanent.
func (m *migrator) prepare(ctx context.Context, tr value.Transformer, kv *mvccpb.KeyValue) (rewrite, string, error) {
	dataCtx := value.DefaultContext(kv.Key)
	plain, stale, err := tr.TransformFromStorage(ctx, kv.Value, dataCtx)
	if isTransient(err) {
		// The plugin, not the value, failed: stop instead of counting it unreadable.
		return rewrite{}, "", transient(kv.Key, err)
	}
	if err != nil {
		m.log.V(2).Info("Leaving an object that cannot be decrypted", "key", string(kv.Key), "err", err)
		return rewrite{}, resultUnreadable, nil
	}
	if !stale {
		return rewrite{}, resultCurrent, nil
	}
	if err := checkStoredObject(plain); err != nil {
		m.log.Info("Leaving an object whose decrypted value is not a Kubernetes object; a wrong key may have read it", "key", string(kv.Key))
		return rewrite{}, resultUnreadable, nil
	}
	out, err := tr.TransformToStorage(ctx, plain, dataCtx)
	if isTransient(err) {
		return rewrite{}, "", transient(kv.Key, err)
	}
	if err != nil {
		return rewrite{}, "", fmt.Errorf("re-encrypting %s with the write key failed (nothing was written): %w", kv.Key, err)
	}
	return rewrite{key: kv.Key, val: out, modRev: kv.ModRevision, lease: kv.Lease}, "", nil
}

func (m *migrator) count(resource, result string) {
	switch result {
	case resultRewritten:
		m.c.rewritten.Add(1)
	case resultCurrent:
		m.c.current.Add(1)
	case resultGone:
		m.c.gone.Add(1)
	case resultUnreadable:
		m.c.unreadable.Add(1)
	}
	m.opts.Metrics.object(resource, result, 1)
}

func putOp(rw rewrite) clientv3.Op {
	if rw.lease != 0 {
		// Keep the object's lease (e.g. events with a TTL); an expired lease deleted
		// the key, and the compare below then fails.
		return clientv3.OpPut(string(rw.key), string(rw.val), clientv3.WithLease(clientv3.LeaseID(rw.lease)))
	}
	return clientv3.OpPut(string(rw.key), string(rw.val))
}

// commit writes a batch in one transaction that succeeds only if no object of the
// batch changed since it was read. If any did, every object is retried on its own.
func (m *migrator) commit(ctx context.Context, tr value.Transformer, resource string, batch []rewrite) error {
	if m.limiter != nil {
		if err := m.limiter.WaitN(ctx, len(batch)); err != nil {
			return err
		}
	}
	cmps := make([]clientv3.Cmp, len(batch))
	puts := make([]clientv3.Op, len(batch))
	for i, rw := range batch {
		cmps[i] = clientv3.Compare(clientv3.ModRevision(string(rw.key)), "=", rw.modRev)
		puts[i] = putOp(rw)
	}
	resp, err := m.opts.Client.Txn(ctx).If(cmps...).Then(puts...).Commit()
	if err != nil {
		return fmt.Errorf("writing %d re-encrypted %s to etcd: %w", len(batch), resource, err)
	}
	if resp.Succeeded {
		m.c.rewritten.Add(int64(len(batch)))
		m.opts.Metrics.object(resource, resultRewritten, len(batch))
		return nil
	}
	for _, rw := range batch {
		if err := m.commitOne(ctx, tr, resource, rw); err != nil {
			return err
		}
	}
	return nil
}

// commitOne swaps one object; on a conflict it re-reads the object and rewrites it
// from its new value if that is still stale.
func (m *migrator) commitOne(ctx context.Context, tr value.Transformer, resource string, rw rewrite) error {
	key := string(rw.key)
	for attempt := 0; attempt < maxConflictRetries; attempt++ {
		resp, err := m.opts.Client.Txn(ctx).
			If(clientv3.Compare(clientv3.ModRevision(key), "=", rw.modRev)).
			Then(putOp(rw)).
			Else(clientv3.OpGet(key)).
			Commit()
		if err != nil {
			return fmt.Errorf("writing re-encrypted %s to etcd: %w", key, err)
		}
		if resp.Succeeded {
			m.count(resource, resultRewritten)
			return nil
		}
		m.c.conflicts.Add(1)
		m.opts.Metrics.object(resource, resultConflict, 1)
		kvs := resp.Responses[0].GetResponseRange().GetKvs()
		if len(kvs) == 0 {
			m.count(resource, resultGone)
			return nil
		}
		next, result, err := m.prepare(ctx, tr, kvs[0])
		if err != nil {
			return err
		}
		if result != "" {
			m.count(resource, result)
			return nil
		}
		rw = next
	}
	// Left stale; the verifying re-scan finds it and the next pass tries again.
	m.log.Info("Object kept changing while it was being re-encrypted; leaving it to the next pass", "key", key)
	return nil
}
