package kmsv2

import (
	"bytes"
	"context"
	"fmt"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"k8s.io/apiserver/pkg/storage/value"
	testingclock "k8s.io/utils/clock/testing"

	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/state"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

// writers seal values through tr on several goroutines until stop, and keep every
// stored value with its plaintext; any failed write fails the test.
type writers struct {
	t      *testing.T
	tr     value.Transformer
	prefix []byte
	wg     sync.WaitGroup
	stop   atomic.Bool
	mu     sync.Mutex
	stored map[string][]byte // plaintext → stored value
	failed atomic.Int64
}

func startWriters(t *testing.T, tr value.Transformer, p *Provider, n, each int) *writers {
	w := &writers{t: t, tr: tr, prefix: p.Prefix(), stored: map[string][]byte{}}
	for g := range n {
		w.wg.Go(func() {
			for i := 0; (each == 0 && !w.stop.Load()) || i < each; i++ {
				w.write(fmt.Sprintf("writer %d value %d", g, i))
			}
		})
	}
	return w
}

func (w *writers) write(pt string) {
	out, err := w.tr.TransformToStorage(context.Background(), []byte(pt), aad)
	if err != nil {
		if w.failed.Add(1) == 1 {
			w.t.Errorf("write %q failed: %v", pt, err)
		}
		return
	}
	w.mu.Lock()
	w.stored[pt] = out
	w.mu.Unlock()
}

// finish stops the writers and checks that every value reads back, and returns how many
// distinct DEK seeds encrypted them.
func (w *writers) finish() int {
	w.stop.Store(true)
	w.wg.Wait()
	seeds := map[string]bool{}
	for pt, out := range w.stored {
		got, _, err := w.tr.TransformFromStorage(context.Background(), out, aad)
		if err != nil || string(got) != pt {
			w.t.Fatalf("read of %q: %q, %v", pt, got, err)
		}
		var o wire.Object
		var inline [wire.MaxInlineAnnotations]wire.Annotation
		if _, err := wire.Decode(bytes.TrimPrefix(out, w.prefix), &o, inline[:]); err != nil {
			w.t.Fatal(err)
		}
		seeds[string(o.DEKSource)] = true
	}
	if w.failed.Load() > 0 {
		w.t.Fatalf("%d writes failed", w.failed.Load())
	}
	return len(seeds)
}

// waitGeneration waits (on published views, not by sleeping) until p writes with DEK
// seed generation gen or later.
func waitGeneration(t *testing.T, p *Provider, gen uint64) *state.WriteState {
	t.Helper()
	deadline := time.After(10 * time.Second)
	for {
		p.mu.Lock()
		ch := p.changed
		p.mu.Unlock()
		if ws := p.write.Load(); ws != nil && ws.spec.Generation >= gen {
			return ws.spec
		}
		select {
		case <-ch:
		case <-deadline:
			t.Fatalf("no DEK seed generation %d within 10s (at %d)", gen, p.write.Load().spec.Generation)
		}
	}
}

// A seed that reached its age bound is replaced under the same key id while writes go
// on: none fails, and everything written under either seed reads back.
func TestSeedReplacedAfterMaxAge(t *testing.T) {
	tp := startPlugin(t, "key-1")
	clk := testingclock.NewFakeClock(time.Now())
	tr, p := loadOursWith(t, tp, "kms1", transformers.Options{Clock: clk}, FactoryOptions{SeedMaxAge: 10 * time.Minute})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	w := startWriters(t, tr, p, 4, 0)
	// A minute at a time, each with a healthy Status, so writes never expire for a jump
	// of the fake clock (3 min after the last healthy Status).
	for range 9 {
		clk.Step(time.Minute)
		if err := p.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	if g := p.write.Load().spec.Generation; g != 1 {
		t.Fatalf("generation %d after 9 minutes, want 1 (bound 10 minutes)", g)
	}
	clk.Step(time.Minute)
	if err := p.Check(ctx); err != nil {
		t.Fatal(err)
	}
	ws := waitGeneration(t, p, 2)
	if ws.Refresh != state.RefreshAge || ws.KeyID != "key-1" {
		t.Fatalf("new seed: refresh %q key id %q, want age under key-1", ws.Refresh, ws.KeyID)
	}
	w.write("under the new seed")
	if seeds := w.finish(); seeds != 2 {
		t.Fatalf("values written under %d seeds, want 2", seeds)
	}
	if n := tp.Stats().Encrypt; n != 2 {
		t.Fatalf("%d Encrypt calls, want 2 (the first seed and its replacement)", n)
	}
}

// A seed that encrypted SeedMaxWrites values is replaced while concurrent writes go on:
// none fails or waits for the plugin, and every value reads back.
func TestSeedReplacedAfterMaxWrites(t *testing.T) {
	tp := startPlugin(t, "key-1")
	tr, p := loadOurs(t, tp, "kms1", FactoryOptions{SeedMaxWrites: 500})
	w := startWriters(t, tr, p, 8, 200)
	w.wg.Wait()
	ws := waitGeneration(t, p, 2)
	if ws.Refresh != state.RefreshWrites {
		t.Fatalf("new seed: refresh %q, want writes", ws.Refresh)
	}
	w.write("under the new seed")
	if seeds := w.finish(); seeds < 2 {
		t.Fatalf("1,600 values written under %d seed(s), want at least 2 with a bound of 500", seeds)
	}
}

// A decrypted DEK source that no read used for DEKCacheIdle leaves the cache (the next
// read asks the plugin again); one that is read stays.
func TestDEKCacheIdleExpiry(t *testing.T) {
	tp := startPlugin(t, "key-1")
	writer := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	stored := sealOpen(t, writer, []byte("v"))[len(writer.Prefix()):]

	clk := testingclock.NewFakeClock(time.Now())
	reader := newProviderWith(t, "kms1", tp.endpoint, transformers.Options{Clock: clk}, FactoryOptions{DEKCacheIdle: time.Hour})
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	read := func(wantDecrypts int64) {
		t.Helper()
		before := tp.Stats().Decrypt
		if got, _, err := reader.Open(ctx, stored, aad); err != nil || string(got) != "v" {
			t.Fatalf("read: %q, %v", got, err)
		}
		if d := tp.Stats().Decrypt - before; d != wantDecrypts {
			t.Fatalf("%d Decrypt calls for the read, want %d", d, wantDecrypts)
		}
	}
	// step moves the reader's clock and lets its loop run (a Check waits for it).
	step := func(d time.Duration) {
		t.Helper()
		clk.Step(d)
		if err := reader.Check(ctx); err != nil {
			t.Fatal(err)
		}
	}
	read(1)
	read(0)
	step(50 * time.Minute)
	read(0) // used after 50 minutes: its idle time starts again
	step(50 * time.Minute)
	read(0)
	step(61 * time.Minute)
	read(1) // idle for 61 minutes: dropped, asked again
	read(0)
	if n := reader.dek.len(); n != 2 {
		t.Fatalf("%d DEK cache entries, want 2 (the reader's write seed and the one read again)", n)
	}
}
