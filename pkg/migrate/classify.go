package migrate

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"sort"
	"strconv"

	"github.com/rekey-io/rekey/pkg/transformers"
	"github.com/rekey-io/rekey/pkg/transformers/kmsv2/wire"
)

const (
	encryptedMarker = transformers.EncryptedMarker
	// maxGuessedKeyName bounds how far a key name is looked for in a value whose key the
	// configuration does not know.
	maxGuessedKeyName = 64
)

// Bucket is one kind of stored value: the provider and key it was written with. It
// never holds key material; a KMS key id only as "sha256:<hex>".
type Bucket struct {
	// Provider is identity, aesgcm, aescbc, secretbox, kms (v2), kmsv1 or unknown.
	Provider string `json:"provider"`
	// Key is the key name (local providers) or the KMS provider name. For a key the
	// configuration does not know it is the name read from the value (up to the next
	// ':'), or "" when none could be read.
	Key string `json:"key,omitempty"`
	// KeyIDHash is "sha256:<hex>" of a KMS v2 value's key id, read from the stored
	// EncryptedObject without calling the plugin.
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// DEKSourceType is a KMS v2 value's encryptedDEKSourceType.
	DEKSourceType string `json:"dekSourceType,omitempty"`
	// Prefix is the full stored prefix ("" for plaintext).
	Prefix string `json:"prefix"`
	// KnownKey is false when the configuration has no key for this prefix: such values
	// cannot be read with it.
	KnownKey bool `json:"knownKey"`
	// Stale is true when the value was not written with the resource's current write
	// provider and key (for KMS v2: key id), so a migration rewrites it.
	Stale bool `json:"stale"`
	// Other marks a bucket that collects the values of every bucket beyond a
	// resource's first 64 (see ResourceInventory.OtherBuckets). It keeps Provider,
	// Stale, KnownKey and, for a prefix the configuration can read, Prefix and Key; a
	// prefix it cannot read becomes "k8s:enc:", and the key id hash is dropped.
	Other bool `json:"other,omitempty"`
}

// maxBucketsPerResource bounds the distinct buckets of one resource's inventory (and so
// its rekey_storage_objects series) beyond those of the configuration's own keys. Every
// key name or KMS key id found in etcd makes a bucket, so a corrupt or hostile etcd
// could otherwise make one per object; values of further buckets are counted in
// "other" buckets. Buckets of a prefix the configuration reads (and, for KMS v2, of the
// current write key id) are always kept: their number is bounded by the configuration,
// and a flood of unknown names must not push them out.
const maxBucketsPerResource = 64

// maxTrackedOtherBuckets bounds the memory spent counting distinct collapsed buckets;
// beyond it ResourceInventory.OtherBuckets is a lower bound.
const maxTrackedOtherBuckets = 10_000

// bucketBound admits the configuration's buckets and the first maxBucketsPerResource
// distinct other buckets of one resource, and collapses the rest into "other" buckets,
// counting how many distinct ones it collapsed.
type bucketBound struct {
	cl       *classifier
	admitted map[Bucket]struct{}
	others   map[[sha256.Size]byte]struct{}
}

func newBucketBound(cl *classifier) *bucketBound {
	return &bucketBound{cl: cl, admitted: map[Bucket]struct{}{}, others: map[[sha256.Size]byte]struct{}{}}
}

// admit returns b itself while the bound allows, else its "other" bucket.
func (bb *bucketBound) admit(b Bucket) Bucket {
	if bb.cl.readable[b.Prefix] && (b.KeyIDHash == "" || b.KeyIDHash == bb.cl.target.KeyIDHash) {
		return b
	}
	if _, ok := bb.admitted[b]; ok {
		return b
	}
	if len(bb.admitted) < maxBucketsPerResource {
		bb.admitted[b] = struct{}{}
		return b
	}
	if len(bb.others) < maxTrackedOtherBuckets {
		h := sha256.New()
		for _, f := range []string{b.Provider, b.Key, b.KeyIDHash, b.DEKSourceType, b.Prefix, strconv.FormatBool(b.KnownKey), strconv.FormatBool(b.Stale)} {
			h.Write([]byte(f))
			h.Write([]byte{0})
		}
		bb.others[[sha256.Size]byte(h.Sum(nil))] = struct{}{}
	}
	o := Bucket{Provider: b.Provider, Key: b.Key, Prefix: b.Prefix, KnownKey: b.KnownKey, Stale: b.Stale, Other: true}
	if o.Prefix != "" && !bb.cl.readable[o.Prefix] {
		// A prefix the configuration cannot read (an unknown key name) is what varies
		// without bound; keep only that it is encrypted.
		o.Prefix, o.Key = encryptedMarker, ""
	}
	return o
}

// otherBuckets is how many distinct buckets admit collapsed (a lower bound beyond
// maxTrackedOtherBuckets).
func (bb *bucketBound) otherBuckets() int64 { return int64(len(bb.others)) }

// classifier sorts stored values of one resource into buckets by their prefix alone.
type classifier struct {
	target  writeTarget
	dekType string // current KMS write DEK source type, "" if unknown
	// known are the prefixes of the configuration, longest first, so a key name that
	// is a prefix of another (k1 / k1:x) resolves to the longer one.
	known [][]byte
	// readable are the prefixes of this resource's rule.
	readable map[string]bool
}

func newClassifier(rule transformers.RuleInfo, known []string) *classifier {
	c := &classifier{target: targetOf(rule), readable: map[string]bool{}}
	if rule.KMS != nil {
		c.dekType = rule.KMS.DEKSourceType
	}
	all := append(append([]string(nil), known...), rule.ReadPrefixes...)
	sort.Slice(all, func(i, j int) bool { return len(all[i]) > len(all[j]) })
	for _, p := range all {
		if p != "" {
			c.known = append(c.known, []byte(p))
		}
	}
	for _, p := range rule.ReadPrefixes {
		c.readable[p] = true
	}
	return c
}

// classify returns the bucket of a stored value. It allocates only the strings of the
// bucket; callers aggregate buckets by value.
func (c *classifier) classify(v []byte) Bucket {
	if !bytes.HasPrefix(v, []byte(encryptedMarker)) {
		b := Bucket{Provider: transformers.ProviderIdentity, KnownKey: c.readable[""]}
		b.Stale = c.target.Prefix != ""
		return b
	}
	var b Bucket
	for _, p := range c.known {
		if bytes.HasPrefix(v, p) {
			b.Prefix = string(p)
			b.KnownKey = true
			break
		}
	}
	if b.Prefix == "" {
		b.Prefix = guessPrefix(v)
	}
	b.Provider, b.Key = transformers.SplitPrefix(b.Prefix)
	if b.Provider == transformers.ProviderKMSv2 {
		var o wire.Object
		var annos [wire.MaxInlineAnnotations]wire.Annotation
		if _, err := wire.Decode(v[len(b.Prefix):], &o, annos[:]); err == nil {
			sum := sha256.Sum256(o.KeyID)
			b.KeyIDHash = "sha256:" + hex.EncodeToString(sum[:])
			b.DEKSourceType = o.SourceType.String()
		} else {
			// Cannot be read by any KMS v2 provider: they decode it the same way.
			b.KnownKey = false
		}
	}
	if !c.readable[b.Prefix] {
		b.KnownKey = false
	}
	b.Stale = c.stale(b)
	return b
}

func (c *classifier) stale(b Bucket) bool {
	if b.Prefix != c.target.Prefix {
		return true
	}
	if b.Provider != transformers.ProviderKMSv2 {
		return false
	}
	if c.target.KeyIDHash != "" && b.KeyIDHash != c.target.KeyIDHash {
		return true
	}
	return c.dekType != "" && b.DEKSourceType != "" && b.DEKSourceType != c.dekType
}

// guessPrefix reads the prefix of a value whose key the configuration does not know:
// k8s:enc:<provider>:<version>:<name>: when the name is printable and short, else just
// k8s:enc:<provider>:<version>: (or k8s:enc: alone).
func guessPrefix(v []byte) string {
	rest := v[len(encryptedMarker):]
	end := len(encryptedMarker)
	// provider and version
	for field := 0; field < 2; field++ {
		i := bytes.IndexByte(rest, ':')
		if i <= 0 || i > 16 || !printable(rest[:i]) {
			return string(v[:end])
		}
		end += i + 1
		rest = rest[i+1:]
	}
	i := bytes.IndexByte(rest, ':')
	if i <= 0 || i > maxGuessedKeyName || !printable(rest[:i]) {
		return string(v[:end])
	}
	return string(v[:end+i+1])
}

func printable(b []byte) bool {
	for _, c := range b {
		if c < 0x21 || c > 0x7e {
			return false
		}
	}
	return true
}
