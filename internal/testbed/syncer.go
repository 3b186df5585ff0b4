package testbed

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"time"
)

// SyncMode is how a FileSyncer replaces a file.
type SyncMode int

const (
	// SyncSymlinkSwap does what the kubelet does for a mounted Secret or ConfigMap:
	// the file is a symlink into ..data, a symlink to a timestamped directory; an
	// update writes a new directory and renames a new ..data symlink over the old.
	SyncSymlinkSwap SyncMode = iota
	// SyncRename writes a temporary file next to the file and renames it over it, as
	// editors and config management do.
	SyncRename
)

// FileSyncer applies a change to several copies of a file, each after its own
// random delay, as kubelets on different nodes refresh one mounted Secret at
// different moments. The delays come from a seeded RNG, so a failing run replays
// with the same seed.
type FileSyncer struct {
	files    []string
	minDelay time.Duration
	maxDelay time.Duration
	mode     SyncMode
	seed     uint64
	logf     func(format string, args ...any)

	mu  sync.Mutex
	rng *rand.Rand
}

// SyncerConfig configures a FileSyncer.
type SyncerConfig struct {
	// Files are the copies, one per node.
	Files []string
	// MinDelay and MaxDelay bound each file's delay (defaults 0 and 10 s).
	MinDelay, MaxDelay time.Duration
	// Mode is how files are replaced (default SyncSymlinkSwap).
	Mode SyncMode
	// Seed seeds the delays; 0 picks one from the clock. It is logged either way.
	Seed uint64
	// Logf receives one line per round and per file update (t.Logf); nil is silent.
	Logf func(format string, args ...any)
}

// NewFileSyncer returns a syncer for the files. Files in SyncSymlinkSwap mode must
// have been created with InitSyncedFile (or be written by this syncer's Init).
func NewFileSyncer(c SyncerConfig) (*FileSyncer, error) {
	if len(c.Files) == 0 {
		return nil, errors.New("file syncer: no files")
	}
	if c.MaxDelay == 0 && c.MinDelay == 0 {
		c.MaxDelay = 10 * time.Second
	}
	if c.MinDelay < 0 || c.MaxDelay < c.MinDelay {
		return nil, fmt.Errorf("file syncer: delay range [%v, %v] is empty", c.MinDelay, c.MaxDelay)
	}
	if c.Seed == 0 {
		c.Seed = uint64(time.Now().UnixNano())
	}
	if c.Logf == nil {
		c.Logf = func(string, ...any) {}
	}
	s := &FileSyncer{files: slices.Clone(c.Files), minDelay: c.MinDelay, maxDelay: c.MaxDelay, mode: c.Mode,
		seed: c.Seed, logf: c.Logf, rng: rand.New(rand.NewPCG(c.Seed, 0x5eed))}
	s.logf("file syncer: seed %d, delays in [%v, %v], %d files", c.Seed, c.MinDelay, c.MaxDelay, len(c.Files))
	return s, nil
}

// Seed is the RNG seed; pass it back in SyncerConfig.Seed to replay the delays.
func (s *FileSyncer) Seed() uint64 { return s.seed }

// Files are the synced paths.
func (s *FileSyncer) Files() []string { return slices.Clone(s.files) }

// Init writes content to every file at once, with no delay.
func (s *FileSyncer) Init(content []byte) error {
	for _, f := range s.files {
		if err := writeSynced(s.mode, f, content); err != nil {
			return err
		}
	}
	return nil
}

// SyncRound is one change being applied.
type SyncRound struct {
	// Started is when Apply was called.
	Started time.Time
	// Delays are each file's delay, by file index; a file the round skips has -1.
	Delays []time.Duration

	done    chan struct{}
	mu      sync.Mutex
	applied []time.Time
	errs    []error
}

// Apply writes content to every file, each after its own delay, in the background.
func (s *FileSyncer) Apply(ctx context.Context, content []byte) *SyncRound {
	return s.ApplyEach(ctx, func(int) []byte { return content }, nil)
}

// ApplyEach writes contentFor(i) to file i after its delay, for the files in only
// (nil: all). Content may differ per file, as a KMS endpoint does per node.
func (s *FileSyncer) ApplyEach(ctx context.Context, contentFor func(i int) []byte, only []int) *SyncRound {
	if only == nil {
		for i := range s.files {
			only = append(only, i)
		}
	}
	r := &SyncRound{Started: time.Now(), Delays: make([]time.Duration, len(s.files)),
		done: make(chan struct{}), applied: make([]time.Time, len(s.files))}
	for i := range r.Delays {
		r.Delays[i] = -1
	}
	s.mu.Lock()
	for _, i := range only {
		r.Delays[i] = s.minDelay + time.Duration(s.rng.Int64N(int64(s.maxDelay-s.minDelay)+1))
	}
	s.mu.Unlock()
	order := slices.Clone(only)
	slices.SortStableFunc(order, func(a, b int) int { return int(r.Delays[a] - r.Delays[b]) })
	var plan []string
	for _, i := range order {
		plan = append(plan, fmt.Sprintf("#%d after %v", i, r.Delays[i].Round(time.Millisecond)))
	}
	s.logf("file syncer (seed %d): %s", s.seed, strings.Join(plan, ", "))

	var wg sync.WaitGroup
	for _, i := range only {
		wg.Go(func() {
			t := time.NewTimer(r.Delays[i])
			defer t.Stop()
			select {
			case <-ctx.Done():
				r.fail(fmt.Errorf("%s: not updated: %w", s.files[i], ctx.Err()))
				return
			case <-t.C:
			}
			if err := writeSynced(s.mode, s.files[i], contentFor(i)); err != nil {
				r.fail(err)
				return
			}
			now := time.Now()
			r.mu.Lock()
			r.applied[i] = now
			r.mu.Unlock()
			s.logf("file syncer: #%d updated at +%v", i, now.Sub(r.Started).Round(time.Millisecond))
		})
	}
	go func() {
		wg.Wait()
		close(r.done)
	}()
	return r
}

func (r *SyncRound) fail(err error) {
	r.mu.Lock()
	r.errs = append(r.errs, err)
	r.mu.Unlock()
}

// Done is closed once every file of the round is written (or failed).
func (r *SyncRound) Done() <-chan struct{} { return r.done }

// Wait waits for the round and returns when the last file was updated.
func (r *SyncRound) Wait(ctx context.Context) (last time.Time, err error) {
	select {
	case <-ctx.Done():
		return time.Time{}, ctx.Err()
	case <-r.done:
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if err := errors.Join(r.errs...); err != nil {
		return time.Time{}, err
	}
	for _, t := range r.applied {
		if t.After(last) {
			last = t
		}
	}
	return last, nil
}

// Applied is when file i was updated, zero if not (yet).
func (r *SyncRound) Applied(i int) time.Time {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.applied[i]
}

// InitSyncedFile creates path in SyncSymlinkSwap layout with content: path is a
// symlink to ..data/<base>, ..data a symlink to a timestamped directory.
func InitSyncedFile(path string, content []byte) error {
	if err := os.MkdirAll(filepath.Dir(path), 0o700); err != nil {
		return err
	}
	return writeSynced(SyncSymlinkSwap, path, content)
}

func writeSynced(mode SyncMode, path string, content []byte) error {
	if mode == SyncRename {
		return WriteFileAtomic(path, content)
	}
	dir, base := filepath.Split(path)
	// 1. The new version in a fresh directory.
	version, err := os.MkdirTemp(dir, "..20")
	if err != nil {
		return err
	}
	if err := os.WriteFile(filepath.Join(version, base), content, 0o600); err != nil {
		return err
	}
	// 2. Swap ..data to it in one rename.
	data := filepath.Join(dir, "..data")
	old, _ := os.Readlink(data)
	tmp := filepath.Join(dir, "..data_tmp")
	_ = os.Remove(tmp)
	if err := os.Symlink(filepath.Base(version), tmp); err != nil {
		return err
	}
	if err := os.Rename(tmp, data); err != nil {
		return err
	}
	// 3. The user-visible name points into ..data (once).
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		if err := os.Symlink(filepath.Join("..data", base), path); err != nil {
			return err
		}
	} else if err != nil {
		return err
	}
	// 4. The old version goes, as the kubelet removes it.
	if old != "" && old != filepath.Base(version) {
		return os.RemoveAll(filepath.Join(dir, old))
	}
	return nil
}
