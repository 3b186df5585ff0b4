package migrate

import (
	"context"
	"errors"
	"sync"
	"testing"
)

// memCheckpoints is a CheckpointStore in memory that counts its calls.
type memCheckpoints struct {
	mu           sync.Mutex
	c            *Checkpoint
	loads, saves int
}

func (m *memCheckpoints) Load(context.Context) (*Checkpoint, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.loads++
	if m.c == nil {
		return nil, nil
	}
	c := *m.c
	return &c, nil
}

func (m *memCheckpoints) Save(c *Checkpoint) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	m.saves++
	cp := *c
	cp.Done = append([]string(nil), c.Done...)
	m.c = &cp
	return nil
}

func (m *memCheckpoints) String() string { return "memory" }

// TestMigrateWithCheckpointStore: Options.Checkpoints replaces the file: a stopped run
// leaves its progress there and a resumed run continues from it.
func TestMigrateWithCheckpointStore(t *testing.T) {
	cli := startEtcd(t)
	_, old := setFor(t, "secrets, configmaps", "aescbc:key1")
	writeObjects(t, cli, old, secrets, 400)
	_, next := setFor(t, "secrets, configmaps", "aesgcm:new", "aescbc:key1")
	store := &memCheckpoints{}

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	_, err := Migrate(ctx, Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 50, Checkpoints: store,
		Progress: func(p Progress) {
			if p.Resource == "secrets" && p.Done >= 200 {
				cancel()
			}
		}})
	if !errors.Is(err, context.Canceled) {
		t.Fatalf("first run: %v, want context.Canceled", err)
	}
	c, _ := store.Load(context.Background())
	if c == nil || c.Resource != "secrets" || c.LastKey == "" || c.Completed || store.saves == 0 {
		t.Fatalf("store after the stop: %+v (saves %d)", c, store.saves)
	}
	res, err := Migrate(context.Background(), Options{Client: cli, Source: FromSet(next), Resources: testResources(), PageSize: 50, Checkpoints: store, Resume: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Scanned >= 400+400 || res.Rewritten != 400 {
		t.Fatalf("resumed run: scanned %d, rewritten %d; want it to continue after the checkpoint", res.Scanned, res.Rewritten)
	}
	if c, _ := store.Load(context.Background()); c == nil || !c.Completed {
		t.Fatalf("store after the resumed run: %+v, want completed", c)
	}
}
