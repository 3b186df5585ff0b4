package migrate

import (
	"encoding/json"
	"fmt"
	"time"
)

// The JSON shape of the storage types, as the status document and `rekey inventory -o
// json` show them (docs/status.md): durations are strings with units ("1.52s"), lists
// are [] when empty, never null, and times are RFC 3339 in UTC. Decoding also accepts
// the older shape, where a duration was a number of nanoseconds.

// jsonDuration is a time.Duration written as its String form.
type jsonDuration time.Duration

func (d jsonDuration) MarshalJSON() ([]byte, error) {
	return json.Marshal(time.Duration(d).String())
}

func (d *jsonDuration) UnmarshalJSON(data []byte) error {
	var s string
	if err := json.Unmarshal(data, &s); err != nil {
		var ns int64
		if json.Unmarshal(data, &ns) != nil {
			return fmt.Errorf("duration %s: want a string such as \"1.5s\"", data)
		}
		*d = jsonDuration(ns)
		return nil
	}
	v, err := time.ParseDuration(s)
	if err != nil {
		return fmt.Errorf("duration %q: %w", s, err)
	}
	*d = jsonDuration(v)
	return nil
}

func utc(t time.Time) time.Time {
	if t.IsZero() {
		return t
	}
	return t.UTC()
}

func nonNil[T any](s []T) []T {
	if s == nil {
		return []T{}
	}
	return s
}

type inventoryFields Inventory

// MarshalJSON writes Duration as a string with units and Resources as [] when empty.
func (inv Inventory) MarshalJSON() ([]byte, error) {
	f := inventoryFields(inv)
	f.Resources = nonNil(f.Resources)
	// The outer members shadow the embedded ones of the same name and keep their order.
	return json.Marshal(struct {
		TakenAt  time.Time    `json:"takenAt"`
		Duration jsonDuration `json:"duration"`
		inventoryFields
	}{utc(inv.TakenAt), jsonDuration(inv.Duration), f})
}

// UnmarshalJSON reads what MarshalJSON writes (and the older nanosecond durations).
func (inv *Inventory) UnmarshalJSON(data []byte) error {
	in := struct {
		*inventoryFields
		Duration jsonDuration `json:"duration"`
	}{inventoryFields: (*inventoryFields)(inv)}
	if err := json.Unmarshal(data, &in); err != nil {
		return err
	}
	inv.Duration = time.Duration(in.Duration)
	return nil
}

type resourceInventoryFields ResourceInventory

// MarshalJSON writes Buckets and UnreadableKeys as [] when empty.
func (r ResourceInventory) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		resourceInventoryFields
		UnreadableKeys []string `json:"unreadableKeys"`
		Buckets        []Count  `json:"buckets"`
	}{resourceInventoryFields(r), nonNil(r.UnreadableKeys), nonNil(r.Buckets)})
}

type migrationRecordFields MigrationRecord

// MarshalJSON writes Duration as a string with units and Resources as [] when empty.
func (m MigrationRecord) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		Resources []string     `json:"resources"`
		Finished  time.Time    `json:"finished"`
		Duration  jsonDuration `json:"duration"`
		migrationRecordFields
	}{nonNil(m.Resources), utc(m.Finished), jsonDuration(m.Duration), migrationRecordFields(m)})
}

// UnmarshalJSON reads what MarshalJSON writes (and the older nanosecond durations).
func (m *MigrationRecord) UnmarshalJSON(data []byte) error {
	in := struct {
		*migrationRecordFields
		Duration jsonDuration `json:"duration"`
	}{migrationRecordFields: (*migrationRecordFields)(m)}
	if err := json.Unmarshal(data, &in); err != nil {
		return err
	}
	m.Duration = time.Duration(in.Duration)
	return nil
}

type controllerStatusFields ControllerStatus

// MarshalJSON writes Running as [] when no migration runs and RetryAt in UTC.
func (s ControllerStatus) MarshalJSON() ([]byte, error) {
	return json.Marshal(struct {
		AutoMigrate bool      `json:"autoMigrate"`
		Running     []string  `json:"running"`
		RetryAt     time.Time `json:"retryAt,omitzero"`
		controllerStatusFields
	}{s.AutoMigrate, nonNil(s.Running), utc(s.RetryAt), controllerStatusFields(s)})
}
