package migrate

import (
	"encoding/json"
	"strings"
	"testing"
	"time"
)

// A person reading the status document sees durations with units, [] for empty lists
// and RFC 3339 times, and the document reads back into the same values.
func TestStorageStatusJSONShape(t *testing.T) {
	taken := time.Date(2026, 11, 23, 18, 4, 5, 250_000_000, time.FixedZone("CET", 3600))
	st := ControllerStatus{
		AutoMigrate: true,
		LastMigration: &MigrationRecord{
			Finished: taken.Add(time.Minute), Duration: 779703 * time.Microsecond,
			Counters: Counters{Scanned: 3, Rewritten: 2, Current: 1},
		},
		Inventory: &Inventory{
			TakenAt: taken, Duration: 1520 * time.Millisecond, ConfigHash: "sha256:ab",
			Resources: []ResourceInventory{{Resource: "secrets", KeyPrefix: "/registry/secrets/", WritePrefix: "k8s:enc:aesgcm:v1:key1:"}},
		},
	}
	data, err := json.Marshal(st)
	if err != nil {
		t.Fatal(err)
	}
	doc := string(data)
	for _, want := range []string{
		`"running":[]`,
		`"duration":"779.703ms"`,
		`"duration":"1.52s"`,
		`"resources":[]`, // the migration record's
		`"buckets":[]`,
		`"unreadableKeys":[]`,
		`"takenAt":"2026-11-23T17:04:05.25Z"`,
		`"finished":"2026-11-23T17:05:05.25Z"`,
	} {
		if !strings.Contains(doc, want) {
			t.Errorf("status JSON lacks %s:\n%s", want, doc)
		}
	}
	if strings.Contains(doc, "null") {
		t.Errorf("status JSON has a null:\n%s", doc)
	}

	var back ControllerStatus
	if err := json.Unmarshal(data, &back); err != nil {
		t.Fatal(err)
	}
	if back.LastMigration.Duration != st.LastMigration.Duration || back.Inventory.Duration != st.Inventory.Duration ||
		!back.Inventory.TakenAt.Equal(taken) || back.Inventory.Resources[0].Resource != "secrets" {
		t.Fatalf("read back %+v / %+v", back.LastMigration, back.Inventory)
	}

	// Documents written before durations had units still read.
	var old Inventory
	if err := json.Unmarshal([]byte(`{"takenAt":"2026-11-23T17:04:05Z","duration":779703,"resources":null}`), &old); err != nil {
		t.Fatal(err)
	}
	if old.Duration != 779703 {
		t.Fatalf("old duration read as %v", old.Duration)
	}
	if err := json.Unmarshal([]byte(`{"duration":"soon"}`), &old); err == nil || !strings.Contains(err.Error(), "soon") {
		t.Fatalf("bad duration: err = %v, want one naming it", err)
	}
}
