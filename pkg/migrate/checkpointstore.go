package migrate

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"strconv"
)

// CheckpointStore keeps a migration's checkpoint somewhere other than CheckpointPath's
// file — in etcd, for example, so that another apiserver resumes a migration where a
// dead one stopped. Load returns (nil, nil) when there is none. String names the
// place for messages.
type CheckpointStore interface {
	Load(ctx context.Context) (*Checkpoint, error)
	Save(*Checkpoint) error
	String() string
}

// fileCheckpoints is the CheckpointStore of the file at Options.CheckpointPath.
type fileCheckpoints string

// Load reads the file; a missing one is (nil, nil).
func (f fileCheckpoints) Load(context.Context) (*Checkpoint, error) {
	data, err := os.ReadFile(string(f))
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading migration checkpoint: %w", err)
	}
	return DecodeCheckpoint(data, strconv.Quote(string(f)))
}

// Save replaces the file atomically.
func (f fileCheckpoints) Save(c *Checkpoint) error { return writeCheckpoint(string(f), c) }

func (f fileCheckpoints) String() string { return string(f) }

// Encode returns c in the checkpoint file's JSON format, for stores that are not files
// (DecodeCheckpoint reads it back).
func (c *Checkpoint) Encode() ([]byte, error) {
	c.Version = checkpointVersion
	return json.Marshal(c)
}

// DecodeCheckpoint parses Checkpoint.Encode's output; where names the store in errors.
func DecodeCheckpoint(data []byte, where string) (*Checkpoint, error) {
	var c Checkpoint
	if err := json.Unmarshal(data, &c); err != nil {
		return nil, fmt.Errorf("migration checkpoint %s is not valid JSON (%v); delete it to start the migration over", where, err)
	}
	if c.Version != checkpointVersion {
		return nil, fmt.Errorf("migration checkpoint %s has format version %d, this rekey reads %d; delete it to start the migration over", where, c.Version, checkpointVersion)
	}
	return &c, nil
}

// checkpoints is the store in use: Options.Checkpoints, else the file at
// CheckpointPath, else nil (no checkpoint).
func (m *migrator) checkpoints() CheckpointStore {
	if m.opts.Checkpoints != nil {
		return m.opts.Checkpoints
	}
	if m.opts.CheckpointPath != "" {
		return fileCheckpoints(m.opts.CheckpointPath)
	}
	return nil
}
