package migrate

import (
	"context"
	"encoding/json"
	"fmt"
	"time"

	"github.com/rekey-io/rekey/internal/atomicfile"
)

// checkpointEvery bounds how often the checkpoint file is rewritten.
const checkpointEvery = 250 * time.Millisecond

// checkpointVersion changes when the file format does.
const checkpointVersion = 1

// Checkpoint is the on-disk progress of a migration: which resources are done and the
// last etcd key of the resource in progress whose page was completely handled. It holds
// etcd keys, prefixes and counts — nothing secret. Resuming from an older checkpoint is
// always safe: objects already rewritten are no longer stale and are skipped, and the
// final verifying re-scan decides whether the migration is finished.
type Checkpoint struct {
	Version int `json:"version"`
	// Targets is what each resource was being rewritten to ("<resource>" → prefix and
	// KMS key id hash). A checkpoint is only resumed when they are unchanged.
	Targets map[string]writeTarget `json:"targets"`
	// Done lists the resources whose first pass finished.
	Done []string `json:"done"`
	// Resource is the resource in progress and LastKey its last handled key.
	Resource string `json:"resource,omitempty"`
	LastKey  string `json:"lastKey,omitempty"`
	// Completed is set when the verifying re-scan found no stale object.
	Completed bool      `json:"completed"`
	Counters  Counters  `json:"counters"`
	UpdatedAt time.Time `json:"updatedAt"`
}

// writeCheckpoint replaces the file at path atomically and durably
// (atomicfile.WriteFile), so a crash leaves either the old or the new checkpoint, never
// a torn one, and never brings back an older one after a save returned.
func writeCheckpoint(path string, c *Checkpoint) error {
	c.Version = checkpointVersion
	data, err := json.MarshalIndent(c, "", "  ")
	if err != nil {
		return err
	}
	if err := atomicfile.WriteFile(path, data, 0o600); err != nil {
		return fmt.Errorf("writing migration checkpoint %q: %w", path, err)
	}
	return nil
}

func (c *Checkpoint) isDone(resource string) bool {
	for _, d := range c.Done {
		if d == resource {
			return true
		}
	}
	return false
}

func sameTargets(a, b map[string]writeTarget) bool {
	if len(a) != len(b) {
		return false
	}
	for k, v := range a {
		if b[k] != v {
			return false
		}
	}
	return true
}

func (m *migrator) loadCheckpoint(ctx context.Context) error {
	targets := m.targets()
	m.ckpt = &Checkpoint{Targets: targets}
	store := m.checkpoints()
	if store == nil {
		return nil
	}
	path := store.String()
	old, err := store.Load(ctx)
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
