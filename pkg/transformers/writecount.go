package transformers

import (
	"cmp"
	"slices"
	"sync"
	"sync/atomic"
)

// WriteCounts counts the values each key sealed (successful TransformToStorage calls),
// keyed by key identity: provider, name and check value for a local key, provider name
// and key id hash for KMS v2. Every Set built with the same WriteCounts
// (Options.WriteCounts) adds to the same counters, so a reload of the same key — a new
// Set from the same secret — continues its count, and a changed secret under the same
// name starts its own. pkg/reload keeps one for the agent's lifetime; nothing here is
// global.
//
// Why count at all: aesgcm draws a random 96-bit nonce per write, and upstream's
// guidance is to rotate its keys every 200,000 writes. The counts are how an operator
// knows when.
type WriteCounts struct {
	mu    sync.Mutex
	byKey map[KeyInfo]*atomic.Uint64
}

// NewWriteCounts returns an empty set of counters.
func NewWriteCounts() *WriteCounts { return &WriteCounts{byKey: map[KeyInfo]*atomic.Uint64{}} }

// KeyWrites is one key's count: what a member publishes and the status shows.
type KeyWrites struct {
	KeyInfo
	// Writes is the number of values sealed with the key since this process started.
	Writes uint64 `json:"writes"`
}

// counter returns k's counter, creating it at zero. Called when a Set is built (local
// keys) or when a KMS key id changes, never per write.
func (w *WriteCounts) counter(k KeyInfo) *atomic.Uint64 {
	w.mu.Lock()
	defer w.mu.Unlock()
	c, ok := w.byKey[k]
	if !ok {
		c = new(atomic.Uint64)
		w.byKey[k] = c
	}
	return c
}

// Snapshot lists every key counted so far (keys with no write yet included, once a Set
// made them writable), sorted by provider, name, check value and key id hash.
func (w *WriteCounts) Snapshot() []KeyWrites {
	if w == nil {
		return nil
	}
	w.mu.Lock()
	out := make([]KeyWrites, 0, len(w.byKey))
	for k, c := range w.byKey {
		out = append(out, KeyWrites{KeyInfo: k, Writes: c.Load()})
	}
	w.mu.Unlock()
	slices.SortFunc(out, func(a, b KeyWrites) int { return CompareKeys(a.KeyInfo, b.KeyInfo) })
	return out
}

// CompareKeys orders keys by provider, name, check value and key id hash.
func CompareKeys(a, b KeyInfo) int {
	return cmp.Or(cmp.Compare(a.Provider, b.Provider), cmp.Compare(a.Key, b.Key),
		cmp.Compare(a.Check, b.Check), cmp.Compare(a.KeyIDHash, b.KeyIDHash))
}

// WriteKeyIDHasher is implemented by a KMS v2 provider that can say, cheaply, under
// which key id ("sha256:<hex>") it writes now; "" before its first DEK seed.
type WriteKeyIDHasher interface {
	WriteKeyIDHash() string
}

// sealCounter counts the successful writes of one chain entry.
type sealCounter struct {
	// fixed is a local key's counter, resolved when the Set was built.
	fixed *atomic.Uint64
	// A KMS v2 entry's key id changes while the Set serves: its counter is resolved
	// again when the provider reports another key id. A write that races with a key id
	// change may be counted under the neighbouring key id; the total is exact.
	kms    WriteKeyIDHasher
	counts *WriteCounts
	name   string
	cur    atomic.Pointer[kmsCount]
}

type kmsCount struct {
	keyIDHash string
	n         *atomic.Uint64
}

// newSealCounter returns the counter of s, nil for what has no key to wear out
// (identity) or is never written (KMS v1).
func newSealCounter(counts *WriteCounts, s Sealer) *sealCounter {
	provider, name := describe(s)
	switch {
	case provider == ProviderKMSv2:
		if h, ok := s.(WriteKeyIDHasher); ok {
			return &sealCounter{kms: h, counts: counts, name: name}
		}
	case provider == ProviderKMSv1 || provider == ProviderIdentity:
	default:
		if ck, ok := s.(checked); ok {
			return &sealCounter{fixed: counts.counter(KeyInfo{Provider: provider, Key: name, Check: ck.checkValue()})}
		}
	}
	return nil
}

func (c *sealCounter) add() {
	if c.fixed != nil {
		c.fixed.Add(1)
		return
	}
	h := c.kms.WriteKeyIDHash()
	if h == "" {
		return
	}
	cur := c.cur.Load()
	if cur == nil || cur.keyIDHash != h {
		cur = &kmsCount{keyIDHash: h, n: c.counts.counter(KeyInfo{Provider: ProviderKMSv2, Key: c.name, KeyIDHash: h})}
		c.cur.Store(cur)
	}
	cur.n.Add(1)
}
