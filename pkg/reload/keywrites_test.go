package reload

import (
	"context"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// statusWrites is the status document's count of the aesgcm key named name.
func statusWrites(t *testing.T, st Status, name string) (transformers.KeyWrites, bool) {
	t.Helper()
	for _, k := range st.KeyWrites {
		if k.Provider == transformers.ProviderAESGCM && k.Key == name {
			return k, true
		}
	}
	return transformers.KeyWrites{}, false
}

// A reload that keeps a key continues its count (status document and
// rekey_key_writes_total), and a new write key starts its own.
func TestKeyWritesContinueAcrossReloads(t *testing.T) {
	f := newFixture(t, secretsConfig("aesgcm:k1"))
	for range 3 {
		f.mustWrite(secrets, "/registry/secrets/ns/a", "v")
	}
	reload := func(content string) {
		t.Helper()
		writeRename(t, f.path, content)
		if err := f.agent.Reload(context.Background()); err != nil {
			t.Fatal(err)
		}
	}
	reload(secretsConfig("aesgcm:k1,k2")) // another file, the same write key
	for range 4 {
		f.mustWrite(secrets, "/registry/secrets/ns/a", "v")
	}
	reload(secretsConfig("aesgcm:k2,k1"))
	for range 2 {
		f.mustWrite(secrets, "/registry/secrets/ns/a", "v")
	}
	st := f.agent.Status()
	k1, ok1 := statusWrites(t, st, "k1")
	k2, ok2 := statusWrites(t, st, "k2")
	if !ok1 || !ok2 || k1.Writes != 7 || k2.Writes != 2 {
		t.Fatalf("status keyWrites %+v: want k1 7 and k2 2", st.KeyWrites)
	}
	if k1.Check == "" {
		t.Fatal("a local key's count carries no check value: two secrets under one name would share it")
	}
	got := f.metric(KeyWritesMetric, map[string]string{"provider": "aesgcm", "key": "k1", "check": k1.Check})
	if got != 7 {
		t.Fatalf("%s{key=k1} = %v, want 7", KeyWritesMetric, got)
	}
}
