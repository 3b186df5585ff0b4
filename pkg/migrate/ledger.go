package migrate

// The migration's own writes, kept so that its verifying re-scan need not read them
// back.
//
// The verifying re-scan is a whole read of every resource, values included, with a
// decrypt check: at a million Secrets it took 17.5 of a migration's 37.5 minutes, and
// in a 20,000-Secret migration under a client workload its worst second was the
// clients' worst. Most of what it reads is what the migration itself has just written.
// An object whose etcd ModRevision is still the revision of the migration's
// transaction that wrote it holds exactly the bytes that transaction put (a revision
// names one transaction, and every later write of the key changes its ModRevision);
// the migration decrypted those bytes back before it wrote them (prepare), so the
// re-scan knows their bucket, size and decrypt check without reading them. It reads
// every key with its ModRevision (keys only) and the values of the rest: the objects
// written by anybody else since.

import (
	"fmt"
	"hash/maphash"
	"math"
	"slices"
	"sort"
	"strings"
	"sync"

	"go.etcd.io/etcd/api/v3/etcdserverpb"
)

// writeLedger is what a migration's transactions wrote, per resource. It is safe for
// concurrent use (the workers record their transactions as they commit). It holds 16
// bytes per object written (a hash of its key, its size and bucket), 16 MB at a
// million, and no key: it only has to tell apart the objects of one transaction, whose
// keys the re-scan reads.
type writeLedger struct {
	seed      maphash.Seed
	mu        sync.Mutex
	resources map[string]*resourceLedger
}

// resourceLedger holds one resource's transactions, by etcd revision, with the
// classification their buckets were sorted by: a re-scan whose classifier differs (a
// reload changed the write key, the known keys or the readable ones) cannot use them.
type resourceLedger struct {
	classes string
	cl      *classifier
	txns    map[int64]*ledgerTxn
	// cluster is the etcd cluster the transactions were written to and last the
	// highest revision among them: a re-scan of another cluster, or of a store whose
	// revision is below it (restored from a snapshot without a revision bump, which
	// reuses revisions), cannot use them.
	cluster uint64
	last    int64
}

// ledgerTxn is one transaction of the migration: its objects sorted by key hash, and
// the buckets they are in.
type ledgerTxn struct {
	objects []ledgerObject
	buckets []Bucket
}

type ledgerObject struct {
	keyHash uint64
	bytes   uint32
	bucket  uint16
}

// find returns the object of the transaction whose key hashes to h.
func (t *ledgerTxn) find(h uint64) (ledgerObject, bool) {
	i, ok := slices.BinarySearchFunc(t.objects, h, func(o ledgerObject, h uint64) int {
		switch {
		case o.keyHash < h:
			return -1
		case o.keyHash > h:
			return 1
		}
		return 0
	})
	if !ok {
		return ledgerObject{}, false
	}
	return t.objects[i], true
}

func newWriteLedger() *writeLedger {
	return &writeLedger{seed: maphash.MakeSeed(), resources: map[string]*resourceLedger{}}
}

func (l *writeLedger) keyHash(key []byte) uint64 { return maphash.Bytes(l.seed, key) }

// begin is called when a pass starts on a resource whose values cl classifies: the
// transactions recorded under another classification are dropped.
func (l *writeLedger) begin(resource string, cl *classifier) {
	l.mu.Lock()
	defer l.mu.Unlock()
	fp := cl.fingerprint()
	if r := l.resources[resource]; r != nil && r.classes == fp {
		return
	}
	l.resources[resource] = &resourceLedger{classes: fp, cl: cl, txns: map[int64]*ledgerTxn{}}
}

// record notes that the transaction at revision rev wrote batch. A transaction is
// recorded only when every value of it was decrypted back as current before the write
// (rewrite.readBack) and is current and readable for the classification the pass began
// with; otherwise the re-scan reads it.
func (l *writeLedger) record(resource string, cluster uint64, rev int64, batch []rewrite) {
	if l == nil || len(batch) == 0 {
		return
	}
	for _, rw := range batch {
		if !rw.readBack || uint64(len(rw.val)) > math.MaxUint32 {
			return
		}
	}
	l.mu.Lock()
	r := l.resources[resource]
	l.mu.Unlock()
	if r == nil {
		return
	}
	t := &ledgerTxn{objects: make([]ledgerObject, 0, len(batch))}
	for _, rw := range batch {
		b := r.cl.classify(rw.val)
		if b.Stale || !b.KnownKey {
			// Written under a configuration the pass did not start with (a reload
			// in between): whatever the re-scan's configuration, it reads it.
			return
		}
		i := slices.Index(t.buckets, b)
		if i < 0 {
			if len(t.buckets) > math.MaxUint16 {
				return
			}
			i = len(t.buckets)
			t.buckets = append(t.buckets, b)
		}
		t.objects = append(t.objects, ledgerObject{keyHash: l.keyHash(rw.key), bytes: uint32(len(rw.val)), bucket: uint16(i)})
	}
	slices.SortFunc(t.objects, func(a, b ledgerObject) int {
		switch {
		case a.keyHash < b.keyHash:
			return -1
		case a.keyHash > b.keyHash:
			return 1
		}
		return 0
	})
	for i := 1; i < len(t.objects); i++ {
		if t.objects[i].keyHash == t.objects[i-1].keyHash {
			return // two keys of one transaction hash alike: it cannot tell them apart
		}
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	if len(r.txns) > 0 && r.cluster != cluster {
		// Written to two etcd clusters: trust neither.
		r.txns, r.last = map[int64]*ledgerTxn{}, 0
		return
	}
	r.cluster, r.last = cluster, max(r.last, rev)
	r.txns[rev] = t
}

// carried is a resource's transactions for its re-scan.
type carried struct {
	l    *writeLedger
	txns map[int64]*ledgerTxn
}

// forScan returns the transactions of resource if the re-scan classifies its values
// as they were classified when written, and etcd, answering with header, is the
// cluster they were written to with its revision not below theirs (ok false
// otherwise, or when there are none). They are not modified any more: the scan runs
// after the pass.
func (l *writeLedger) forScan(resource string, cl *classifier, header *etcdserverpb.ResponseHeader) (carried, bool) {
	if l == nil || header == nil {
		return carried{}, false
	}
	l.mu.Lock()
	defer l.mu.Unlock()
	r := l.resources[resource]
	if r == nil || len(r.txns) == 0 || r.classes != cl.fingerprint() || header.ClusterId != r.cluster || header.Revision < r.last {
		return carried{}, false
	}
	return carried{l: l, txns: r.txns}, true
}

// lookup returns what the migration wrote of the object at key, if it is still as a
// transaction of the migration wrote it (its ModRevision is the transaction's).
func (c carried) lookup(key []byte, modRev int64) (Bucket, int64, bool) {
	t := c.txns[modRev]
	if t == nil {
		return Bucket{}, 0, false
	}
	o, ok := t.find(c.l.keyHash(key))
	if !ok {
		return Bucket{}, 0, false
	}
	return t.buckets[o.bucket], int64(o.bytes), true
}

// fingerprint names everything classify's verdict depends on besides the value: two
// classifiers with one fingerprint sort every value into the same bucket.
func (c *classifier) fingerprint() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%q %q %q|", c.target.Prefix, c.target.KeyIDHash, c.dekType)
	for _, p := range c.known {
		fmt.Fprintf(&b, "%q ", p)
	}
	readable := make([]string, 0, len(c.readable))
	for p, ok := range c.readable {
		if ok {
			readable = append(readable, p)
		}
	}
	sort.Strings(readable)
	fmt.Fprintf(&b, "|%q", readable)
	return b.String()
}

// addCarried counts an object the re-scan did not read: as a transaction of the
// migration wrote it into bucket b, size bytes, readable and current.
func (t *tally) addCarried(key []byte, b Bucket, size int64) {
	t.count(key, b, size, false)
	t.ri.Carried++
}
