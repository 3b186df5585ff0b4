package pace

// Space awareness: every rewrite adds an etcd revision that stays in the database
// until kube-apiserver's compaction (every 5 minutes) frees it. A fast migration can
// therefore grow the database to etcd's space quota, where etcd raises the NOSPACE
// alarm and refuses every write of the cluster. The migration stops short of that.

import (
	"fmt"
	"time"
)

// Space defaults.
const (
	// DefaultEtcdQuotaBytes is etcd's default --quota-backend-bytes (2 GiB). etcd has
	// no API that reports its quota: set SpaceOptions.QuotaBytes to what the etcd
	// members run with.
	DefaultEtcdQuotaBytes = 2 << 30
	// DefaultMaxDBFraction is the share of the quota a migration writes up to.
	DefaultMaxDBFraction = 0.75
	// DefaultSpaceCheckInterval is how often etcd's database size and alarms are read
	// while a migration writes (also when its own writes have not used up the room
	// measured last: others write too). While paused it is how often the migration
	// looks again.
	DefaultSpaceCheckInterval = 5 * time.Second
	// writeOverhead: the database grows by more than the bytes written (bbolt pages,
	// the key index, the revision's metadata); room is counted at this many bytes per
	// byte written, and measured again once it is used up.
	writeOverhead = 2
	// minRoomBytes: with less room than this, pause rather than write in slivers
	// (two of pkg/migrate's largest transactions, its DefaultBatchBytes of 1 MiB).
	minRoomBytes = 2 << 20
	// readingLag: etcd reports the database size of its last backend commit (every
	// 100 ms by default), so a reading may not show the writes of just before it.
	// Room handed out this long before a reading is counted as used still.
	readingLag = time.Second
	// unknownRetry: a reading that failed (etcd electing a leader, a member lost) is
	// tried again this soon, not after a whole CheckInterval: the migration is paused
	// until a reading succeeds.
	unknownRetry = 500 * time.Millisecond
)

// Pause reasons (the reason label of rekey_storage_migration_paused).
const (
	PauseDBSize  = "db-size"        // the database is at the fraction of the quota
	PauseNoSpace = "nospace-alarm"  // etcd raised NOSPACE (someone filled it)
	PauseUnknown = "status-unknown" // etcd's size could not be read
)

// SpaceOptions bound how much of etcd's space a migration may use. The zero value is
// the defaults.
type SpaceOptions struct {
	// QuotaBytes is the etcd members' --quota-backend-bytes (0: DefaultEtcdQuotaBytes).
	QuotaBytes int64
	// MaxFraction of QuotaBytes is where writing pauses (0: DefaultMaxDBFraction).
	MaxFraction float64
	// CheckInterval: see DefaultSpaceCheckInterval.
	CheckInterval time.Duration
}

func (o SpaceOptions) withDefaults() SpaceOptions {
	if o.QuotaBytes <= 0 {
		o.QuotaBytes = DefaultEtcdQuotaBytes
	}
	if o.MaxFraction <= 0 || o.MaxFraction > 1 {
		o.MaxFraction = DefaultMaxDBFraction
	}
	if o.CheckInterval <= 0 {
		o.CheckInterval = DefaultSpaceCheckInterval
	}
	return o
}

// Validate reports options that cannot be met (pkg/layer words the same checks as
// flag errors).
func (o SpaceOptions) Validate() error {
	if o.QuotaBytes < 0 {
		return fmt.Errorf("etcd quota %d bytes: must be 0 (etcd's default, 2 GiB) or the members' --quota-backend-bytes", o.QuotaBytes)
	}
	if o.MaxFraction < 0 || o.MaxFraction > 1 {
		return fmt.Errorf("database fraction %v: must be above 0 and at most 1 (0: the default %v)", o.MaxFraction, DefaultMaxDBFraction)
	}
	return nil
}

// etcdSpace is one reading of etcd: the largest member's database file and the part
// of it in use, and whether a NOSPACE alarm is raised.
type etcdSpace struct {
	DBSize, DBSizeInUse int64
	NoSpace             bool
	// Err is why etcd could not be read; the other fields are then meaningless.
	Err error
}

// spaceGate decides whether the migration may write, in etcd raft's shape (no I/O, no
// clock): the driver asks it about the bytes it is about to write (Admit) and Steps it
// with the readings of etcd it asks for (Measured).
//
// etcd refuses writes once its database file would exceed the quota. Writes first
// fill the pages compaction freed (DBSize − DBSizeInUse), then grow the file, so the
// room left below the limit (MaxFraction × QuotaBytes) is limit − DBSizeInUse, less
// what was handed out too shortly before the reading for it to show (readingLag). The
// gate hands that room out, counted at writeOverhead per byte, and asks for a new
// reading when it is spent: the migration's own writes can never take the database
// past the limit between two readings. Room only comes back when compaction (and, for
// the file, defrag) frees space: kube-apiserver's and the operator's business, never
// the migration's.
type spaceGate struct {
	opts SpaceOptions
	// room is the bytes that may still be written before the next reading.
	room int64
	// measuredAt is the last reading's time; zero before the first. fresh: no write
	// was admitted since.
	measuredAt time.Time
	fresh      bool
	last       etcdSpace
	reason     string
	// recent is the room handed out within readingLag, oldest first; settleAt is when
	// the last reading's oldest one is sure to show in a new reading.
	recent   []grant
	settleAt time.Time
}

// grant is room handed out at a time.
type grant struct {
	at    time.Time
	bytes int64
}

// spaceDecision is the gate's answer to Admit.
type spaceDecision int

const (
	spaceWrite   spaceDecision = iota // write: the room is reserved
	spaceMeasure                      // read etcd, Step Measured, then ask again
	spaceWait                         // ask again after RetryIn
)

func newSpaceGate(opts SpaceOptions) *spaceGate { return &spaceGate{opts: opts.withDefaults()} }

// limit is the database size the migration stays under.
func (g *spaceGate) limit() int64 {
	return int64(float64(g.opts.QuotaBytes) * g.opts.MaxFraction)
}

// Admit decides about writing n bytes at now.
func (g *spaceGate) Admit(now time.Time, n int64) spaceDecision {
	need := n * writeOverhead
	switch {
	case g.measuredAt.IsZero() || now.Sub(g.measuredAt) >= g.measureEvery():
		return spaceMeasure
	case g.reason != "":
		return spaceWait
	case g.room >= need:
		g.room -= need
		g.fresh = false
		g.forget(now)
		g.recent = append(g.recent, grant{at: now, bytes: need})
		return spaceWrite
	case !g.fresh:
		// The room is spent: read again.
		return spaceMeasure
	case now.Before(g.settleAt):
		// The reading is too recent to show the last writes: wait for it to.
		return spaceWait
	case !g.settleAt.IsZero():
		return spaceMeasure
	}
	// A reading that shows every write leaves too little room for this one.
	g.reason = PauseDBSize
	return spaceWait
}

// measureEvery is how long a reading stands: CheckInterval, or unknownRetry after a
// failed one.
func (g *spaceGate) measureEvery() time.Duration {
	if g.reason == PauseUnknown {
		return min(unknownRetry, g.opts.CheckInterval)
	}
	return g.opts.CheckInterval
}

// RetryIn is how long to wait after spaceWait before asking again.
func (g *spaceGate) RetryIn(now time.Time) time.Duration {
	if g.reason == "" && now.Before(g.settleAt) {
		return g.settleAt.Sub(now)
	}
	return max(g.measuredAt.Add(g.measureEvery()).Sub(now), 0)
}

// Measured feeds a reading taken at now.
func (g *spaceGate) Measured(now time.Time, s etcdSpace) {
	g.measuredAt, g.last, g.fresh = now, s, true
	switch {
	case s.Err != nil:
		g.reason, g.room = PauseUnknown, 0
	case s.NoSpace:
		g.reason, g.room = PauseNoSpace, 0
	default:
		g.forget(now)
		g.room, g.reason, g.settleAt = g.limit()-s.DBSizeInUse, "", time.Time{}
		if g.room < minRoomBytes {
			g.reason, g.room = PauseDBSize, 0
			break
		}
		for _, r := range g.recent {
			g.room -= r.bytes
		}
		if len(g.recent) > 0 {
			g.settleAt = g.recent[0].at.Add(readingLag)
		}
		g.room = max(g.room, 0)
	}
}

// forget drops the room handed out longer than readingLag before now: any reading
// from now on shows it.
func (g *spaceGate) forget(now time.Time) {
	i := 0
	for i < len(g.recent) && now.Sub(g.recent[i].at) >= readingLag {
		i++
	}
	g.recent = g.recent[i:]
}

// NoSpace feeds a write refused by etcd for lack of space at now (the alarm was
// raised between two readings, by someone else).
func (g *spaceGate) NoSpace(now time.Time) {
	g.Measured(now, etcdSpace{DBSize: g.last.DBSize, DBSizeInUse: g.last.DBSizeInUse, NoSpace: true})
}

// Paused is the reason writing is paused, "" when it is not.
func (g *spaceGate) Paused() string { return g.reason }

// Condition describes the pause for the status document and the log.
func (g *spaceGate) Condition() string {
	switch g.reason {
	case PauseDBSize:
		return fmt.Sprintf("etcd's database uses %s of %s (quota %s, pausing at %.0f%%); waiting for compaction (kube-apiserver compacts every 5 minutes) and, to shrink the file, a defragmentation",
			bytesText(g.last.DBSizeInUse), bytesText(g.last.DBSize), bytesText(g.opts.QuotaBytes), 100*g.opts.MaxFraction)
	case PauseNoSpace:
		return "etcd raised the NOSPACE alarm (its database reached the quota); the cluster is read-only until an operator compacts, defragments and disarms the alarm (etcdctl alarm disarm)"
	case PauseUnknown:
		return fmt.Sprintf("etcd's database size could not be read (%v); not writing without knowing the room left", g.last.Err)
	}
	return ""
}

func bytesText(n int64) string {
	return fmt.Sprintf("%.1f MiB", float64(n)/(1<<20))
}
