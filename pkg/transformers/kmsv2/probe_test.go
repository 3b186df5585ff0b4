package kmsv2

import (
	"bytes"
	"context"
	"testing"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// A read marked transformers.UncachedKMS asks the plugin every time and caches
// nothing, so it sees what the cached DEKs hide: here the key behind a stable key id
// got other material (an alias re-pointed), and only the uncached read fails.
func TestUncachedReadAsksThePlugin(t *testing.T) {
	tp := startPlugin(t, "probe-k1")
	p := newProvider(t, "kms1", tp.endpoint, FactoryOptions{})
	stored := sealOpen(t, p, []byte("secret"))
	body := stored[len(p.Prefix()):]
	probe := transformers.UncachedKMS{Context: aad}

	before, cached, aeads := tp.Stats().Decrypt, p.dek.len(), p.aeads.len()
	for range 2 {
		got, stale, err := p.Open(context.Background(), body, probe)
		if err != nil || stale || !bytes.Equal(got, []byte("secret")) {
			t.Fatalf("uncached Open = %q, stale %v, %v; want the plaintext", got, stale, err)
		}
	}
	if n := tp.Stats().Decrypt - before; n != 2 {
		t.Fatalf("%d plugin Decrypt calls for two uncached reads, want 2", n)
	}
	if n := p.dek.len(); n != cached {
		t.Fatalf("%d DEKs cached after uncached reads, want the %d of before", n, cached)
	}
	if n := p.aeads.len(); n != aeads {
		t.Fatalf("%d derived AEADs cached after uncached reads, want the %d of before", n, aeads)
	}

	// The same key id, other material.
	keySecrets["probe-k1"] = newKey()
	tp.writeKeys(t, "probe-k1")
	if got, _, err := p.Open(context.Background(), body, aad); err != nil || !bytes.Equal(got, []byte("secret")) {
		t.Fatalf("cached Open after the key's material changed = %q, %v; want the plaintext (the DEK is in memory)", got, err)
	}
	_, _, err := p.Open(context.Background(), body, probe)
	if err == nil {
		t.Fatal("uncached Open succeeded although the plugin's key for the key id changed")
	}
	if transformers.PluginUnreachable(err) {
		t.Fatalf("uncached Open error %v counted as an unreachable plugin; the plugin answered", err)
	}
}
