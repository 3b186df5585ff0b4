package migrate

import (
	"context"
	"errors"
	"fmt"
	"math"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.etcd.io/etcd/api/v3/mvccpb"
	clientv3 "go.etcd.io/etcd/client/v3"
	"k8s.io/klog/v2"
	"k8s.io/utils/clock"

	"github.com/rekey-io/rekey/pkg/migrate/pace"
)

// Options configure Migrate.
type Options struct {
	Client    *clientv3.Client
	Source    Source
	Resources []Resource
	// Rate is the most objects rewritten per second; 0 means no ceiling. Below it the
	// rate adapts to etcd's latency (see pace.Options).
	Rate float64
	// Pacing tunes the adaptive rate (the zero value is the defaults); its Ceiling is
	// Rate.
	Pacing pace.Options
	// Space bounds how full the migration lets etcd's database get: it pauses before
	// the fraction of the quota and resumes when compaction frees space.
	Space pace.SpaceOptions
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
	// CoordinationPrefix, when set, is where acknowledged unreadable objects are read
	// from: the verifying re-scan does not count them against the migration.
	CoordinationPrefix string
	Logger             klog.Logger
	Clock              clock.Clock
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
	Phase string
	// Paused, when its Reason is set, is why the migration does not write now.
	Paused pace.PauseState
	// AllowedRate is the objects per second the pacer allows now; 0 is no limit.
	AllowedRate float64
	// SlowedBy says why the pacer's rate is below where it started (etcd's latency or
	// errors, or the apiserver's clients); "" when it is not.
	SlowedBy string
	// ClientsOf are the apiservers whose clients the pacer judges ("": this one; the
	// others are a cluster migration's members: pace.Options.Members).
	ClientsOf []string
	Pass      int
	Resource  string
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
	// Acknowledged is how many unreadable objects the final re-scan found acknowledged:
	// the migration is "verified except Acknowledged".
	Acknowledged int64
	// AllowedRate is the pacer's rate when the migration ended, in objects per second
	// (+Inf: no limit): the next migration of the same rotation can resume from it
	// (pace.Options.ResumeRate).
	AllowedRate float64
	// SustainedRate is the highest rate the migration achieved while its clients were
	// answered within target, in objects per second (0: none was judged): where a later
	// migration of the cluster can start (pace.Options.KnownRate).
	SustainedRate float64
	// ClientsOf are the apiservers whose clients paced it (see Progress.ClientsOf).
	ClientsOf []string
	// ClientsHorizon is what its pacing judged of the clients within the horizon:
	// the next migration of the same rotation goes on from it
	// (pace.Options.ResumeHorizon).
	ClientsHorizon pace.ClientsHorizon
}

// newWriter paces the migration's transactions at most at opts.Rate; pauseChanged
// resends the progress when etcd's room pauses or resumes the migration.
func (m *migrator) newWriter(pauseChanged func()) *pace.Writer {
	pacing := m.opts.Pacing
	pacing.Ceiling = m.opts.Rate
	return pace.NewWriter(pace.WriterOptions{
		Client: m.opts.Client, Clock: m.opts.Clock, Logger: m.log,
		Pacing: pacing, Space: m.opts.Space, MaxBatch: m.opts.BatchSize,
		RecordRate: m.opts.Metrics.setAllowedRate, RecordPause: m.opts.Metrics.setPaused,
		PauseChanged: pauseChanged,
	})
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
	opts   Options
	log    klog.Logger
	writer *pace.Writer
	start  time.Time
	c      counters

	// lastProgress is the latest report, sent again when the pause state changes.
	progressMu   sync.Mutex
	lastProgress Progress

	ckpt          *Checkpoint
	lastCkptWrite time.Time

	// ledger is what this migration's transactions wrote, for its verifying re-scan.
	ledger *writeLedger
}

// Migrate rewrites every stale object of opts.Resources through the current
// transformers, then re-scans with a decrypt check; it returns nil only when that
// re-scan finds no stale object and no unreadable one that is not acknowledged (see
// Acknowledge): "verified except N acknowledged".
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
	m := &migrator{opts: opts, log: opts.Logger.WithName("storage-migration"), start: opts.Clock.Now(), ledger: newWriteLedger()}
	if err := opts.Space.Validate(); err != nil {
		return nil, fmt.Errorf("migrate: %w", err)
	}
	if opts.Rate > 0 && float64(opts.BatchSize) > opts.Rate {
		m.opts.BatchSize = max(1, int(opts.Rate))
	}
	m.writer = m.newWriter(m.resendProgress)
	defer m.writer.Close()
	opts.Metrics.setRunning(true)
	defer opts.Metrics.setRunning(false)
	res, err := m.run(ctx)
	if res != nil {
		_, res.AllowedRate, _ = m.writer.State()
		res.SustainedRate = m.writer.SustainedRate()
		res.ClientsOf = m.writer.ClientsOf()
		res.ClientsHorizon = m.writer.ClientsHorizon()
	}
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
	if err := m.loadCheckpoint(ctx); err != nil {
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
			CoordinationPrefix: m.opts.CoordinationPrefix, Clock: m.opts.Clock, Metrics: m.opts.Metrics,
			readPacer: m.writer.ReadPacer(), ledger: m.ledger,
		})
		if err != nil {
			return m.result(res), fmt.Errorf("verifying re-scan: %w", err)
		}
		m.opts.Inventory.setIfNotNil(inv)
		res.Verified = inv
		acknowledged := inv.TotalAcknowledged()
		stale, unreadable := inv.TotalStale(), inv.TotalUnreadable()-acknowledged
		if stale == 0 && unreadable == 0 {
			m.ckpt.Completed = true
			m.saveCheckpoint(true)
			m.log.Info("Storage migration verified: no stale object left", "passes", pass, "rewritten", m.c.rewritten.Load(), "acknowledgedUnreadable", acknowledged, "duration", m.opts.Clock.Since(m.start), "rescan", inv.Duration, "rescanCarried", inv.TotalCarried())
			return m.result(res), nil
		}
		if unreadable > 0 {
			return m.result(res), fmt.Errorf("%w: %d objects cannot be decrypted with the current configuration, or decrypt to something that is not a Kubernetes object (%s), and were left unchanged%s; restore the key they need or delete them, or, if they may stay unreadable, acknowledge them (rekey inventory lists them; rekey migrate --acknowledge-unreadable <resource>/<namespace>/<name> --reason ...), then run the migration again", ErrNotFinished, unreadable, unreadableSample(inv), acknowledgedNote(acknowledged))
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
	if r.Verified != nil {
		r.Acknowledged = r.Verified.TotalAcknowledged()
	}
	return r
}

func (s *InventoryStore) setIfNotNil(inv *Inventory) {
	if s != nil {
		s.Set(inv)
	}
}

func (m *migrator) progress(p Progress) {
	if m.opts.Progress == nil {
		return
	}
	m.progressMu.Lock()
	defer m.progressMu.Unlock()
	m.lastProgress = p
	m.report(p)
}

// resendProgress reports the latest progress again, with the new pause state.
func (m *migrator) resendProgress() {
	if m.opts.Progress == nil {
		return
	}
	m.progressMu.Lock()
	defer m.progressMu.Unlock()
	m.report(m.lastProgress)
}

func (m *migrator) report(p Progress) {
	p.Counters = m.c.snapshot()
	p.Elapsed = m.opts.Clock.Since(m.start)
	var allowed float64
	p.Paused, allowed, p.SlowedBy = m.writer.State()
	p.ClientsOf = m.writer.ClientsOf()
	if !math.IsInf(allowed, 1) {
		p.AllowedRate = allowed
	}
	m.opts.Progress(p)
}

func (m *migrator) migrateResource(ctx context.Context, pass int, r Resource, from string) error {
	name := r.String()
	total, _, err := countKeys(ctx, m.opts.Client, r)
	if err != nil {
		return err
	}
	m.ckpt.Resource, m.ckpt.LastKey = name, ""
	if from != "" {
		m.ckpt.LastKey = strings.TrimSuffix(from, "\x00")
	}
	tr := m.opts.Source.TransformerFor(r.GroupResource)
	m.ledger.begin(name, newClassifier(m.opts.Source.Rule(r.GroupResource), m.opts.Source.KnownPrefixes()))
	m.writer.Migrating(r.GroupResource)
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
