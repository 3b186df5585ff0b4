package cluster

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"fmt"
	"slices"
	"sync"
	"time"

	clientv3 "go.etcd.io/etcd/client/v3"

	"github.com/rekey-io/rekey/pkg/coordination"
	"github.com/rekey-io/rekey/pkg/transformers"
)

// The cluster's lifetime count of values sealed per key.
//
// A member's own count (transformers.WriteCounts) starts at 0 with its process, so the
// sum over live members' records goes down when one restarts and forgets the members
// that are gone. The lifetime total therefore lives in etcd, one key per key identity
// under <prefix>/keywrites/, and each member adds to it what it sealed since it last
// added (its deltas), with a compare-and-swap on the key's revision. No leader is
// involved: a delta is added by the member that made the writes, exactly once, whoever
// else is alive. A member adds its deltas every KeyWritesFlushInterval and once more
// when it closes; a member killed without closing loses at most the writes of its last
// interval (the total then counts low, never high).
//
// The same key records when any member first saw the key (FirstSeen): a member adds a
// key with no writes yet as soon as its configuration can use it, so a write key's age
// starts when it was configured, not at its first write.

// defaultKeyWritesFlushInterval is how often a member adds its write counts to the
// cluster's totals (Options.KeyWritesFlushInterval).
const defaultKeyWritesFlushInterval = 10 * time.Second

// maxPublishedKeyWrites bounds the keys a member record lists in KeyWrites (the ones
// with the most writes): a configuration may name hundreds of keys, and the record
// must stay under maxMemberRecordBytes. The totals in etcd count every key.
const maxPublishedKeyWrites = 32

// KeyWritesKey is where k's total lives: a hash of its identity names the etcd key, so
// key names with any characters fit; the value repeats the identity.
func KeyWritesKey(prefix string, k Key) string {
	sum := sha256.Sum256([]byte(k.Provider + "\x00" + k.Key + "\x00" + k.Check + "\x00" + k.KeyIDHash))
	return coordination.KeyWrites(prefix, hex.EncodeToString(sum[:16]))
}

// KeyTotal is one key's lifetime count in the cluster.
type KeyTotal struct {
	Key
	// Writes is the number of values every member ever sealed with the key, as far as
	// they added them (see the package's note on keywrites).
	Writes uint64 `json:"writes"`
	// FirstSeen is when a member first added the key: the key's age starts there.
	FirstSeen time.Time `json:"firstSeen"`
}

// Age is how long ago the key was first seen.
func (t KeyTotal) Age(now time.Time) time.Duration { return now.Sub(t.FirstSeen) }

// ReadKeyTotals reads every key's total, sorted by key.
func ReadKeyTotals(ctx context.Context, cli *clientv3.Client, prefix string) ([]KeyTotal, error) {
	dir := coordination.KeyWritesPrefix(prefix)
	resp, err := cli.Get(ctx, dir, clientv3.WithPrefix())
	if err != nil {
		return nil, fmt.Errorf("reading the key write totals under %s: %w", dir, err)
	}
	out := make([]KeyTotal, 0, len(resp.Kvs))
	for _, kv := range resp.Kvs {
		var t KeyTotal
		if err := json.Unmarshal(kv.Value, &t); err != nil {
			return nil, fmt.Errorf("key write total at %s is not valid JSON: %w", kv.Key, err)
		}
		out = append(out, t)
	}
	slices.SortFunc(out, func(a, b KeyTotal) int { return transformers.CompareKeys(a.Key, b.Key) })
	return out, nil
}

// FindKeyTotal returns the total of k (the same key: KeyInfo.SameKey), ok false when
// no member added it yet.
func FindKeyTotal(totals []KeyTotal, k Key) (KeyTotal, bool) {
	for _, t := range totals {
		if t.Key.SameKey(k) && t.KeyIDHash == k.KeyIDHash {
			return t, true
		}
	}
	return KeyTotal{}, false
}

// keyWritesFlusher adds one member's deltas to the totals. added is what this process
// added so far per key; it lives as long as the agent's WriteCounts (one per process).
type keyWritesFlusher struct {
	cli    *clientv3.Client
	prefix string

	mu    sync.Mutex
	added map[Key]uint64
}

func newKeyWritesFlusher(cli *clientv3.Client, prefix string) *keyWritesFlusher {
	return &keyWritesFlusher{cli: cli, prefix: prefix, added: map[Key]uint64{}}
}

// flush adds, for every key of counts, what was sealed since the last flush, and
// creates the total of a key no member added before (first seen now).
func (f *keyWritesFlusher) flush(ctx context.Context, counts []transformers.KeyWrites, now time.Time) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	for _, c := range counts {
		added, known := f.added[c.KeyInfo]
		if known && c.Writes <= added {
			continue
		}
		if err := f.add(ctx, c.KeyInfo, c.Writes-added, now); err != nil {
			return err
		}
		f.added[c.KeyInfo] = c.Writes
	}
	return nil
}

// maxCASAttempts bounds the compare-and-swap retries of one key's add: every retry
// means another member added in between, so a handful is plenty.
const maxCASAttempts = 16

func (f *keyWritesFlusher) add(ctx context.Context, k Key, delta uint64, now time.Time) error {
	key := KeyWritesKey(f.prefix, k)
	for range maxCASAttempts {
		resp, err := f.cli.Get(ctx, key)
		if err != nil {
			return fmt.Errorf("reading the write total of %s at %s: %w", k, key, err)
		}
		total := KeyTotal{Key: k, FirstSeen: now.UTC()}
		cmp := clientv3.Compare(clientv3.CreateRevision(key), "=", 0)
		if len(resp.Kvs) == 1 {
			if err := json.Unmarshal(resp.Kvs[0].Value, &total); err != nil {
				return fmt.Errorf("write total of %s at %s is not valid JSON: %w (delete the key; the count restarts)", k, key, err)
			}
			cmp = clientv3.Compare(clientv3.ModRevision(key), "=", resp.Kvs[0].ModRevision)
		}
		total.Writes += delta
		data, err := json.Marshal(total)
		if err != nil {
			return err
		}
		txn, err := f.cli.Txn(ctx).If(cmp).Then(clientv3.OpPut(key, string(data))).Commit()
		if err != nil {
			return fmt.Errorf("adding %d writes to the total of %s at %s: %w", delta, k, key, err)
		}
		if txn.Succeeded {
			return nil
		}
	}
	return fmt.Errorf("adding to the write total of %s at %s: %d other members added at the same time; retrying at the next flush", k, key, maxCASAttempts)
}

// boundKeyWrites keeps the max keys with the most writes (ties: by key), in key order.
func boundKeyWrites(in []transformers.KeyWrites, max int) []transformers.KeyWrites {
	if len(in) <= max {
		return in
	}
	out := slices.Clone(in)
	slices.SortStableFunc(out, func(a, b transformers.KeyWrites) int {
		if a.Writes != b.Writes {
			if a.Writes > b.Writes {
				return -1
			}
			return 1
		}
		return transformers.CompareKeys(a.KeyInfo, b.KeyInfo)
	})
	out = out[:max]
	slices.SortFunc(out, func(a, b transformers.KeyWrites) int { return transformers.CompareKeys(a.KeyInfo, b.KeyInfo) })
	return out
}

// flushKeyWrites adds this member's deltas to the cluster's totals when the interval
// has passed (or force), then reads every total back for the status and the metrics.
func (n *Node) flushKeyWrites(ctx context.Context, force bool) {
	now := n.opts.Clock.Now()
	n.mu.Lock()
	agent, due := n.agent, force || n.lastKeyWritesFlush.IsZero() || now.Sub(n.lastKeyWritesFlush) >= n.opts.KeyWritesFlushInterval
	if agent != nil && due {
		n.lastKeyWritesFlush = now
	}
	n.mu.Unlock()
	if agent == nil || !due {
		return
	}
	fctx, cancel := context.WithTimeout(ctx, etcdTimeout)
	defer cancel()
	if err := n.keyWrites.flush(fctx, agent.OwnStatus().KeyWrites, now); err != nil {
		n.log.Error(err, "Cannot add this apiserver's write counts to the cluster's key totals; retrying at the next flush")
		return
	}
	totals, err := ReadKeyTotals(fctx, n.opts.Client, n.opts.Prefix)
	if err != nil {
		n.log.Error(err, "Cannot read the cluster's key totals")
		return
	}
	n.mu.Lock()
	n.keyTotals = totals
	n.mu.Unlock()
	n.opts.Metrics.setKeyTotals(totals, writingKeys(n.view.Members()))
}

// KeyTotals are the cluster's per-key totals as this member last read them.
func (n *Node) KeyTotals() []KeyTotal {
	n.mu.Lock()
	defer n.mu.Unlock()
	return slices.Clone(n.keyTotals)
}

// writingKeys are the keys some live member writes with now.
func writingKeys(members []MemberState) []Key {
	var out []Key
	for _, m := range members {
		for _, r := range m.Resources {
			if r.Write.Provider != "" && !slices.Contains(out, r.Write) {
				out = append(out, r.Write)
			}
		}
	}
	return out
}
