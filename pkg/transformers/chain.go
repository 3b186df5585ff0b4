package transformers

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"sort"
	"time"

	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime/schema"
	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	"k8s.io/apiserver/pkg/storage/value"
)

// errNoMatchingPrefix is upstream's error when no provider of a resource recognises a
// stored value.
var errNoMatchingPrefix = errors.New("no matching prefix found")

// WriteRefusedError is the error of every write a write fence refuses (Writer.Refuse):
// the apiserver must not write data that no other live apiserver can read. It is a
// ServiceUnavailable API status (apierrors.IsServiceUnavailable holds), and a distinct
// type because k8s.io/apiserver's etcd3 store wraps every transformer error in a
// storage.InternalError that the REST layer turns into a 500: a storage decorator finds
// the refusal under that wrapping with errors.As and answers with Status instead
// (pkg/layer does, for every binary that embeds it).
type WriteRefusedError struct {
	// Reason is the write fence's explanation: the resource, the key this apiserver
	// cannot read and what to add to its configuration. It names keys, never holds them.
	Reason string
	// RetryAfter is set when the refusal is expected to end on its own (Writer.RetryAfter).
	RetryAfter time.Duration
}

var _ apierrors.APIStatus = (*WriteRefusedError)(nil)

func (e *WriteRefusedError) Error() string { return e.Reason }

// Status is the answer to the refused request: 503 ServiceUnavailable with Reason as its
// message. A refusal that lasts until this apiserver's configuration file catches up
// carries no Retry-After: it would make client-go repeat the write against the same
// apiserver up to ten times before the client sees why. One that ends on its own
// (RetryAfter set) carries it, so clients come back instead of failing.
func (e *WriteRefusedError) Status() metav1.Status {
	st := apierrors.NewServiceUnavailable(e.Reason).ErrStatus
	if e.RetryAfter > 0 {
		st.Details = &metav1.StatusDetails{RetryAfterSeconds: int32(max(1, e.RetryAfter.Round(time.Second)/time.Second))}
	}
	return st
}

// Chain is the transformer of one resource rule: the first Sealer writes; on read, every
// Sealer whose prefix matches is tried, longest prefix first (file order among equal
// prefixes), and a value read by any but the first Sealer is stale. It implements
// value.Transformer.
//
// Upstream tries matching prefixes in file order. The two orders differ only when one
// key's prefix is a proper prefix of another's (aescbc keys "a" and "a:<15 chars>"):
// upstream then opens a value of the longer key with the shorter one first, and because
// CBC has no MAC that read "succeeds" with garbage whenever the garbage ends in valid
// padding (about 1 read in 256). Longest-first reads such values correctly; every value
// upstream reads correctly is read the same way, because a longer prefix can only match
// a value of the shorter key if its random IV or nonce happens to spell the rest of the
// longer prefix.
type Chain struct {
	resource string
	sealers  []Sealer
	prefixes [][]byte
	// readOrder lists sealer indexes longest prefix first, stable otherwise.
	readOrder []int
	// emptyPrefix[i] marks identity: its read failures are skipped silently, as upstream.
	emptyPrefix []bool
	obs         []*observers // per sealer, nil when metrics are off
	// counters are per sealer, nil when writes are not counted (and nil for identity).
	counters []*sealCounter
	// writer is the index of the sealer that writes: 0 unless a write fence holds the
	// configuration's first entry back. Staleness stays relative to entry 0.
	writer int
	// refuse, when set, is why a write fence refuses every write of this rule;
	// retryAfter is Writer.RetryAfter.
	refuse     string
	retryAfter time.Duration
}

var _ value.Transformer = (*Chain)(nil)

func newChain(gr schema.GroupResource, resource string, sealers []Sealer, m *Metrics, counts *WriteCounts) *Chain {
	c := &Chain{resource: resource, sealers: sealers}
	for _, s := range sealers {
		if counts != nil {
			c.counters = append(c.counters, newSealCounter(counts, s))
		}
		p := s.Prefix()
		c.prefixes = append(c.prefixes, p)
		c.emptyPrefix = append(c.emptyPrefix, len(p) == 0)
		if m != nil {
			c.obs = append(c.obs, m.observersFor(gr, outerPrefixLabel(s)))
		}
	}
	c.readOrder = make([]int, len(sealers))
	for i := range c.readOrder {
		c.readOrder[i] = i
	}
	sort.SliceStable(c.readOrder, func(a, b int) bool {
		return len(c.prefixes[c.readOrder[a]]) > len(c.prefixes[c.readOrder[b]])
	})
	return c
}

// withWriter returns a copy of c that writes with the entry w chooses, or refuses.
func (c *Chain) withWriter(w Writer) *Chain {
	d := *c
	d.writer, d.refuse, d.retryAfter = w.Index, w.Refuse, w.RetryAfter
	return &d
}

// TransformToStorage encrypts with the write entry: the first provider and its first
// key, unless a write fence chose another entry (Set.WithWriters). While a write fence
// refuses writes it fails with a *WriteRefusedError naming why: the apiserver must not
// write data the other apiservers cannot read.
func (c *Chain) TransformToStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, error) {
	if c.refuse != "" {
		return nil, &WriteRefusedError{Reason: c.refuse, RetryAfter: c.retryAfter}
	}
	if c.obs == nil {
		out, err := c.sealers[c.writer].Seal(ctx, data, dataCtx)
		c.countWrite(err)
		return out, err
	}
	start := now()
	out, err := c.sealers[c.writer].Seal(ctx, data, dataCtx)
	c.obs[c.writer].write(start, err)
	c.countWrite(err)
	return out, err
}

// countWrite counts a successful write against the writing key (WriteCounts).
func (c *Chain) countWrite(err error) {
	if err == nil && c.counters != nil {
		if sc := c.counters[c.writer]; sc != nil {
			sc.add()
		}
	}
}

// TransformFromStorage finds the providers whose prefix the value carries and returns
// the first successful read, trying longer prefixes first; stale is true unless the
// first provider's first key read it.
func (c *Chain) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	var errs []error
	for _, i := range c.readOrder {
		s := c.sealers[i]
		p := c.prefixes[i]
		if !bytes.HasPrefix(data, p) {
			continue
		}
		var start time.Time
		if c.obs != nil {
			start = now()
		}
		out, stale, err := s.Open(ctx, data[len(p):], dataCtx)
		if err != nil && c.emptyPrefix[i] {
			// identity refusing encrypted data: let a real provider try.
			continue
		}
		if c.obs != nil {
			c.obs[i].read(start, stale, err)
		}
		if err != nil {
			errs = append(errs, err)
			continue
		}
		return out, stale || i != 0, nil
	}
	if len(errs) > 0 {
		return nil, false, utilerrors.Reduce(utilerrors.NewAggregate(errs))
	}
	if c.obs != nil && len(c.sealers) > 0 {
		c.obs[0].unknown()
	}
	return nil, false, errNoMatchingPrefix
}

// Unavailable is the first error of the chain's providers that report an unreachable
// KMS plugin (UnavailableReporter), nil when none does.
func (c *Chain) Unavailable() error {
	for _, s := range c.sealers {
		if r, ok := s.(UnavailableReporter); ok {
			if err := r.Unavailable(); err != nil {
				return err
			}
		}
	}
	return nil
}

// Info describes the chain without key material.
func (c *Chain) Info() RuleInfo {
	w := c.sealers[c.writer]
	info := RuleInfo{Resource: c.resource, WritePrefix: string(c.prefixes[c.writer]), WriteIndex: c.writer}
	info.WriteProvider, info.WriteKey = describe(w)
	if c.refuse != "" {
		info.WriteIndex, info.WriteRefused = NoWriter, c.refuse
	}
	for i, p := range c.prefixes {
		info.ReadPrefixes = append(info.ReadPrefixes, string(p))
		var k KeyInfo
		k.Provider, k.Key = describe(c.sealers[i])
		if ck, ok := c.sealers[i].(checked); ok {
			k.Check = ck.checkValue()
		}
		if kp, ok := c.sealers[i].(KMSProvider); ok {
			st := kp.Status()
			k.KeyIDHash = st.KeyIDHash
			if i == c.writer {
				info.KMS = &st
			}
		}
		info.ReadKeys = append(info.ReadKeys, k)
	}
	return info
}

// describe splits a sealer into provider type and key (or KMS provider) name.
func describe(s Sealer) (provider, key string) { return SplitPrefix(string(s.Prefix())) }

// outerPrefixLabel is the transformer_prefix label upstream records: the provider prefix
// without the key name for local providers (k8s:enc:aesgcm:v1:), the full prefix for KMS
// (k8s:enc:kms:v2:<name>:, k8s:enc:kms:v1:<name>:), "identity" for identity.
func outerPrefixLabel(s Sealer) string {
	p := string(s.Prefix())
	if p == "" {
		return ProviderIdentity
	}
	provider, _ := describe(s)
	if provider == ProviderKMSv2 || provider == ProviderKMSv1 {
		return p
	}
	return fmt.Sprintf("k8s:enc:%s:v1:", provider)
}
