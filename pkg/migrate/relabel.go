package migrate

import (
	"bytes"
	"slices"
	"time"

	"github.com/rekey-io/rekey/pkg/transformers"
)

// relabelInventory returns latest with the staleness of every one of resources judged
// against its write target now, without reading etcd: a write key changed, and the
// objects are where they were (the migration that moves them will re-scan). Counts,
// revisions and unreadable objects stay those of the scan (TakenAt says when);
// RelabelledAt says when the staleness was judged again. It returns false when the
// buckets alone cannot say what a scan would: a resource latest does not cover, other
// wildcard rules, a bucket collapsed into "other", or one whose prefix the new
// configuration resolves, reads or bounds differently (a key added whose prefix extends
// a stored one, a key removed or added for a stored prefix). Every apiserver took a
// scan of every object at each write-key change before: in a 10,000-Secret rotation,
// three apiservers read everything at once while the migration began, and at a million
// objects each of them scanned for tens of seconds to change a label.
func relabelInventory(latest *Inventory, src Source, res Resolution, now time.Time, configHash string) (*Inventory, bool) {
	if latest == nil || !slices.Equal(latest.Wildcards, res.Wildcards) {
		return nil, false
	}
	out := *latest
	out.Resources = make([]ResourceInventory, 0, len(res.Resources))
	out.ConfigHash, out.RelabelledAt = configHash, now
	// Nothing was decrypted with this configuration.
	out.DecryptChecked = false
	known := src.KnownPrefixes()
	for _, r := range res.Resources {
		ri := latest.Find(r.String())
		if ri == nil {
			return nil, false
		}
		nri, ok := relabelResource(*ri, newClassifier(src.Rule(r.GroupResource), known))
		if !ok {
			return nil, false
		}
		out.Resources = append(out.Resources, nri)
	}
	return &out, true
}

// relabelResource judges ri's buckets against cl's write target (see relabelInventory).
func relabelResource(ri ResourceInventory, cl *classifier) (ResourceInventory, bool) {
	if ri.OtherBuckets > 0 {
		return ri, false
	}
	merged := map[Bucket]*Count{}
	bounded := 0
	ri.Stale = 0
	for _, c := range ri.Buckets {
		b, ok := rejudge(c.Bucket, cl)
		if !ok {
			return ri, false
		}
		if !(cl.readable[b.Prefix] && (b.KeyIDHash == "" || b.KeyIDHash == cl.target.KeyIDHash)) {
			bounded++ // what bucketBound admits only up to its bound
		}
		unreadable := c.Unreadable // decrypt check only
		if !b.KnownKey {
			unreadable = c.Objects
		}
		if b.Stale {
			ri.Stale += c.Objects - unreadable
		}
		if m := merged[b]; m != nil {
			// Buckets the decrypt check told apart by staleness are one now.
			m.Objects, m.Unreadable, m.Acknowledged, m.Bytes = m.Objects+c.Objects, m.Unreadable+c.Unreadable, m.Acknowledged+c.Acknowledged, m.Bytes+c.Bytes
			if m.SampleKey == "" {
				m.SampleKey = c.SampleKey
			}
			continue
		}
		c.Bucket = b
		merged[b] = &c
	}
	if bounded > maxBucketsPerResource {
		return ri, false
	}
	// WritePrefix and WriteKeyIDHash stay the scan's: what the objects written since
	// it were written with until the change. The guard tells by them whether the
	// inventory still covers every object (guard.CheckChange: a write target other
	// than the current one makes it outdated); set to the new target, it would let an
	// operator drop the old write key with objects written under it after the scan.
	ri.Buckets = make([]Count, 0, len(merged))
	for _, c := range merged {
		ri.Buckets = append(ri.Buckets, *c)
	}
	sortBuckets(ri.Buckets)
	return ri, true
}

// rejudge returns the bucket values of b's would have under cl, when b alone says:
// their prefix resolves to b's own (no prefix cl knows extends it, and cl knows it
// exactly when b says it was known), and whether cl reads it is what b says.
func rejudge(b Bucket, cl *classifier) (Bucket, bool) {
	if b.Other {
		return b, false
	}
	if b.Prefix == "" {
		if b.Provider != transformers.ProviderIdentity || cl.readable[""] != b.KnownKey {
			return b, false
		}
		b.Stale = cl.target.Prefix != ""
		return b, true
	}
	matched := ""
	for _, p := range cl.known {
		if len(p) > len(b.Prefix) && bytes.HasPrefix(p, []byte(b.Prefix)) {
			return b, false // a value of b's may carry the longer prefix
		}
		if matched == "" && bytes.HasPrefix([]byte(b.Prefix), p) {
			matched = string(p)
		}
	}
	switch {
	case matched != "" && matched != b.Prefix:
		return b, false // cl resolves these values to a shorter prefix
	case matched == "" && guessPrefix([]byte(b.Prefix)) != b.Prefix:
		return b, false // a guess would read another prefix
	}
	knownKey := matched != "" && cl.readable[b.Prefix] && !(b.Provider == transformers.ProviderKMSv2 && b.KeyIDHash == "")
	if knownKey != b.KnownKey {
		return b, false // read before and not now, or the reverse: a scan lists them
	}
	b.Stale = cl.stale(b)
	return b, true
}
