package cluster

import (
	"context"
	"encoding/json"
	"fmt"
	"strings"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/storage/value"

	"github.com/rekey-io/rekey/internal/etcdtest"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// sealN writes n values through the member's transformers, as its apiserver would.
func (m *member) sealN(t *testing.T, n int) {
	t.Helper()
	tr := m.agent.TransformerForResource(secrets)
	for i := range n {
		if _, err := tr.TransformToStorage(context.Background(), []byte("v"), value.DefaultContext(fmt.Sprintf("/registry/secrets/ns/%s-%d", m.id, i))); err != nil {
			t.Fatal(err)
		}
	}
}

// waitWritesWith waits until the member's write fence lets the configured key write:
// a member that (re)starts writes with the key the others write with until then.
func (m *member) waitWritesWith(t *testing.T, key string) {
	t.Helper()
	eventually(t, m.id+" to write with "+key, func() bool { w, _ := m.agent.Rules()[0].Writer(); return w.Key == key })
}

// waitFlushed waits until each member has started two more flushes of its write
// counts (one at a time, so the first of them has ended).
func waitFlushed(t *testing.T, ms ...*member) {
	t.Helper()
	last := func(m *member) time.Time {
		m.node.mu.Lock()
		defer m.node.mu.Unlock()
		return m.node.lastKeyWritesFlush
	}
	for _, m := range ms {
		seen, changes := last(m), 0
		eventually(t, m.id+" to flush its write counts twice more", func() bool {
			if at := last(m); !at.Equal(seen) {
				seen, changes = at, changes+1
			}
			return changes >= 2
		})
	}
}

// aesgcmTotal is the cluster's total of the aesgcm key named name, and whether it exists.
func aesgcmTotal(t *testing.T, m *member, name string) (KeyTotal, bool) {
	t.Helper()
	totals, err := ReadKeyTotals(context.Background(), m.node.opts.Client, m.node.opts.Prefix)
	if err != nil {
		t.Fatal(err)
	}
	for _, tt := range totals {
		if tt.Provider == transformers.ProviderAESGCM && tt.Key.Key == name {
			return tt, true
		}
	}
	return KeyTotal{}, false
}

// TestKeyWriteTotalsAreExact: three members write with one key; the cluster's total
// in etcd is the number of values they sealed, exactly, also across a member's
// restart (its own count starts again at 0) and with the members adding at the same
// time. The key's first-seen time stays what it was.
func TestKeyWriteTotalsAreExact(t *testing.T) {
	srv := etcdtest.Start(t)
	cli := srv.Client(t)
	fast := func(o *Options) { o.KeyWritesFlushInterval = 20 * time.Millisecond }
	cfg := secretsConfig("k1", "k2")
	a := startMember(t, cli, "a", cfg, fast)
	b := startMember(t, cli, "b", cfg, fast)
	c := startMember(t, cli, "c", cfg, fast)
	eventually(t, "three members", func() bool { return memberIDs(a.node.view) == "a,b,c" })
	for _, m := range []*member{a, b, c} {
		m.waitWritesWith(t, "k1")
	}

	a.sealN(t, 101)
	b.sealN(t, 202)
	c.sealN(t, 303)
	eventually(t, "the total of k1 to reach 606", func() bool { k, _ := aesgcmTotal(t, a, "k1"); return k.Writes == 606 })
	first, _ := aesgcmTotal(t, a, "k1")
	if first.FirstSeen.IsZero() || first.Check == "" {
		t.Fatalf("k1's total has no first-seen time or check value: %+v", first)
	}
	if k2, ok := aesgcmTotal(t, a, "k2"); !ok || k2.Writes != 0 {
		t.Fatalf("k2 (configured, read only): %+v (present %v), want a total of 0", k2, ok)
	}

	// b restarts: its writes since the last flush are added when it closes, and its
	// new process counts from 0 without taking anything back.
	b.sealN(t, 17)
	b.stop()
	b = startMember(t, cli, "b", cfg, fast)
	b.waitWritesWith(t, "k1")
	b.sealN(t, 5)
	a.sealN(t, 1)
	eventually(t, "the total of k1 to reach 629", func() bool { k, _ := aesgcmTotal(t, a, "k1"); return k.Writes == 629 })
	// Every member flushes again at least once: nothing is added twice.
	waitFlushed(t, a, b, c)
	if k, _ := aesgcmTotal(t, a, "k1"); k.Writes != 629 || !k.FirstSeen.Equal(first.FirstSeen) {
		t.Fatalf("k1 after more flushes: %d writes first seen %s, want 629 first seen %s", k.Writes, k.FirstSeen, first.FirstSeen)
	}

	// The member records carry each member's own count; the status its totals.
	eventually(t, "c's status to show the total", func() bool {
		for _, k := range c.node.Status().KeyWrites {
			if k.Key.Key == "k1" && k.Writes == 629 {
				return true
			}
		}
		return false
	})
	for _, m := range []*member{a, b, c} {
		m.stop()
	}
	if k, _ := aesgcmTotal(t, &member{node: &Node{opts: Options{Client: cli, Prefix: defaultPrefix}}}, "k1"); k.Writes != 629 {
		t.Fatalf("k1 after every member closed: %d writes, want 629", k.Writes)
	}
}

// A record lists at most maxPublishedKeyWrites counts, the keys with the most writes;
// a record of a version without counts decodes.
func TestPublishedKeyWritesAreBounded(t *testing.T) {
	var in []transformers.KeyWrites
	for i := range maxPublishedKeyWrites + 10 {
		in = append(in, transformers.KeyWrites{KeyInfo: Key{Provider: "aesgcm", Key: fmt.Sprintf("k%03d", i), Check: "c"}, Writes: uint64(i)})
	}
	out := boundKeyWrites(in, maxPublishedKeyWrites)
	if len(out) != maxPublishedKeyWrites || out[0].Key != "k010" || out[len(out)-1].Writes != uint64(maxPublishedKeyWrites+9) {
		t.Fatalf("bounded to %d, first %+v, last %+v", len(out), out[0], out[len(out)-1])
	}
	st := MemberState{APIServerID: "a", KeyWrites: out}
	data, _, err := encodeRecord(st, maxMemberRecordBytes)
	if err != nil || len(data) > maxMemberRecordBytes/4 {
		t.Fatalf("record of %d counts is %d bytes (%v)", len(out), len(data), err)
	}
	old := `{"apiserverID":"a","configHash":"sha256:1","resources":[],"publishedAt":"2026-01-01T00:00:00Z"}`
	if got, err := ParseMemberState([]byte(old)); err != nil || got.KeyWrites != nil {
		t.Fatalf("a record without keyWrites: %+v, %v", got, err)
	}
	var back MemberState
	if err := json.Unmarshal(data, &back); err != nil || len(back.KeyWrites) != len(out) || !strings.Contains(string(data), `"writes":41`) {
		t.Fatalf("round trip: %v, %d counts", err, len(back.KeyWrites))
	}
}
