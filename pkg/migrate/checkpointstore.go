package migrate

import (
	"encoding/json"
	"fmt"
)

// CheckpointStore keeps a migration's checkpoint somewhere other than CheckpointPath's
// file — in etcd, for example, so that another apiserver resumes a migration where a
// dead one stopped. Load returns (nil, nil) when there is none. String names the
// place for messages.
type CheckpointStore interface {
	Load() (*Checkpoint, error)
	Save(*Checkpoint) error
	String() string
}

// FileCheckpoints is the CheckpointStore of a file, the same as Options.CheckpointPath.
type FileCheckpoints string

// Load reads the file; a missing one is (nil, nil).
func (f FileCheckpoints) Load() (*Checkpoint, error) { return ReadCheckpoint(string(f)) }

// Save replaces the file atomically.
func (f FileCheckpoints) Save(c *Checkpoint) error { return writeCheckpoint(string(f), c) }

func (f FileCheckpoints) String() string { return string(f) }

// EncodeCheckpoint returns c in the checkpoint file's JSON format (for stores that are
// not files).
func EncodeCheckpoint(c *Checkpoint) ([]byte, error) {
	c.Version = checkpointVersion
	return json.Marshal(c)
}

// DecodeCheckpoint parses EncodeCheckpoint's output; where names the store in errors.
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
		return FileCheckpoints(m.opts.CheckpointPath)
	}
	return nil
}
