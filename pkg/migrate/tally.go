package migrate

import (
	"sort"

	"go.etcd.io/etcd/api/v3/mvccpb"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// tally counts one resource's stored objects, one at a time, into its inventory: per
// bucket (bounded by bucketBound), stale, plaintext, unreadable and acknowledged, with
// the unreadable keys listed up to their bounds. It reads nothing itself: the pager
// and the decrypt check feed it, so its counting is tested without etcd.
type tally struct {
	res          Resource
	cl           *classifier
	acks         Acknowledgements
	decryptCheck bool

	ri     *ResourceInventory
	counts map[Bucket]*Count
	// unreadableSample says whether a bucket's SampleKey is of an unreadable object.
	unreadableSample map[Bucket]bool
	bound            *bucketBound
}

// newTally starts the tally of res, whose values cl classifies; acks are the
// acknowledged unreadable objects, decryptCheck whether add gets each object's
// decrypt check.
func newTally(res Resource, cl *classifier, acks Acknowledgements, decryptCheck bool) *tally {
	return &tally{
		res: res, cl: cl, acks: acks, decryptCheck: decryptCheck,
		ri: &ResourceInventory{Resource: res.String(), KeyPrefix: res.KeyPrefix, Guessed: res.Guessed,
			WritePrefix: cl.target.Prefix, WriteKeyIDHash: cl.target.KeyIDHash},
		counts: map[Bucket]*Count{}, unreadableSample: map[Bucket]bool{}, bound: newBucketBound(cl),
	}
}

// add counts one stored object; check is its decrypt check (ignored without one).
func (t *tally) add(kv *mvccpb.KeyValue, check checkResult) {
	b := t.cl.classify(kv.Value)
	unreadable := !b.KnownKey
	var decryptErr error
	if t.decryptCheck {
		unreadable, decryptErr = check.err != nil, check.err
		if !unreadable {
			// The transformers' verdict wins: it also sees providers that share
			// a prefix, which the prefix alone cannot tell apart.
			b.Stale = check.stale
		}
	}
	class := ""
	if unreadable {
		// Classified before admit: a collapsed bucket no longer has its prefix.
		class = unreadableClass(b, t.cl.readable[b.Prefix], decryptErr)
	}
	listedPrefix := storedPrefixName(b)
	c := t.count(kv.Key, b, int64(len(kv.Value)), unreadable)
	if !unreadable {
		return
	}
	ri := t.ri
	if t.decryptCheck {
		c.Unreadable++
	}
	ri.Unreadable++
	acked := t.acks.Covers(string(kv.Key), kv.ModRevision)
	if acked {
		ri.Acknowledged++
		c.Acknowledged++
	}
	if len(ri.UnreadableKeys) < maxUnreadableSamples {
		ri.UnreadableKeys = append(ri.UnreadableKeys, string(kv.Key))
	}
	if len(ri.UnreadableObjects) < MaxUnreadableListed {
		ns, name := objectName(t.res, string(kv.Key))
		ri.UnreadableObjects = append(ri.UnreadableObjects, UnreadableObject{Key: string(kv.Key), Namespace: ns, Name: name,
			Prefix: listedPrefix, Class: class, ModRevision: kv.ModRevision, Acknowledged: acked})
	}
}

// count counts one object of size bytes in bucket b (before admit) and returns its
// bucket's count; add counts what is particular to an unreadable one.
func (t *tally) count(key []byte, b Bucket, size int64, unreadable bool) *Count {
	b = t.bound.admit(b)
	c := t.counts[b]
	if c == nil {
		c = &Count{Bucket: b}
		t.counts[b] = c
	}
	c.Objects++
	c.Bytes += size
	if b.Provider == transformers.ProviderKMSv2 && b.KeyIDHash != "" && (c.SampleKey == "" || t.unreadableSample[b] && !unreadable) {
		// A readable sample is preferred: an unreadable one (acknowledged, say)
		// would make the decrypt guard blame a plugin for what no plugin reads.
		c.SampleKey = string(key)
		t.unreadableSample[b] = unreadable
	}
	t.ri.Objects++
	if b.Stale && !unreadable {
		t.ri.Stale++
	}
	if b.Provider == transformers.ProviderIdentity {
		t.ri.Plaintext++
	}
	return c
}

// inventory ends the tally of the resource read at revision: its buckets in a stable
// order (by prefix, key id hash, current before stale).
func (t *tally) inventory(revision int64) *ResourceInventory {
	ri := t.ri
	ri.Revision = revision
	ri.OtherBuckets = t.bound.otherBuckets()
	for _, c := range t.counts {
		ri.Buckets = append(ri.Buckets, *c)
	}
	sort.Slice(ri.Buckets, func(i, j int) bool {
		a, b := ri.Buckets[i], ri.Buckets[j]
		if a.Prefix != b.Prefix {
			return a.Prefix < b.Prefix
		}
		if a.KeyIDHash != b.KeyIDHash {
			return a.KeyIDHash < b.KeyIDHash
		}
		return !a.Stale && b.Stale
	})
	return ri
}
