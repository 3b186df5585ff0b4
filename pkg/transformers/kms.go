package transformers

import (
	"context"
	"errors"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"k8s.io/apimachinery/pkg/runtime/schema"
	"k8s.io/apiserver/pkg/storage/value"
)

// ErrKMSUnavailable is matched (errors.Is) by the errors of a KMS provider that cannot
// serve right now — no write DEK seed yet, writes expired because the plugin has not
// reported healthy — as opposed to errors about the stored value itself. Callers such as
// storage migration retry later instead of treating the data as unreadable. gRPC errors
// of the plugin (Unavailable, DeadlineExceeded, ResourceExhausted) carry their status
// code instead.
var ErrKMSUnavailable = errors.New("kms plugin unavailable")

// PluginUnreachable reports whether err says a KMS plugin was not reached or did not
// answer in time (gRPC Unavailable or DeadlineExceeded, an expired context, or
// ErrKMSUnavailable), as opposed to an answer, an error of the plugin's own included.
func PluginUnreachable(err error) bool {
	if err == nil {
		return false
	}
	if errors.Is(err, context.DeadlineExceeded) || errors.Is(err, ErrKMSUnavailable) {
		return true
	}
	switch status.Code(err) {
	case codes.Unavailable, codes.DeadlineExceeded:
		return true
	}
	return false
}

// Unavailable wraps err so that it matches ErrKMSUnavailable; its message is err's.
func Unavailable(err error) error { return unavailableError{err} }

type unavailableError struct{ error }

func (e unavailableError) Unwrap() error        { return e.error }
func (e unavailableError) Is(target error) bool { return target == ErrKMSUnavailable }

// UnavailableReporter is a provider, or a transformer made of providers, that can say
// that a KMS plugin it needs cannot be reached now (kmsv2.Provider, Chain, and the
// reload agent's transformers).
type UnavailableReporter interface {
	// Unavailable is nil while every KMS plugin is reachable as far as is known, and
	// otherwise an error matching ErrKMSUnavailable that names the provider, its
	// endpoint and the cause, never key material.
	Unavailable() error
}

// UnavailableOf is tr's Unavailable(), or nil when tr cannot tell.
func UnavailableOf(tr value.Transformer) error {
	if r, ok := tr.(UnavailableReporter); ok {
		return r.Unavailable()
	}
	return nil
}

// KMSStatus describes a KMS v2 provider for health and status output. It carries the
// key id only as its "sha256:<hex>" hash, never key material.
type KMSStatus struct {
	// Name is the provider name from the config.
	Name string `json:"name"`
	// Endpoint is the plugin address from the config.
	Endpoint string `json:"endpoint"`
	// Healthy is the result of the latest Status call.
	Healthy bool `json:"healthy"`
	// LastError is the latest failure, empty when healthy.
	LastError string `json:"lastError,omitempty"`
	// KeyIDHash is "sha256:<hex>" of the key id new values are written under.
	KeyIDHash string `json:"keyIDHash,omitempty"`
	// DEKSourceType is the type of the write DEK source (HKDF_SHA256_XNONCE_AES_GCM_SEED or AES_GCM_KEY).
	DEKSourceType string `json:"dekSourceType,omitempty"`
	// WriteExpiry is when writes stop being allowed unless a healthy Status arrives first.
	WriteExpiry time.Time `json:"writeExpiry,omitzero"`
	// LastStatus is when the plugin last answered Status.
	LastStatus time.Time `json:"lastStatus,omitzero"`
	// UnavailableSince is set while the plugin cannot be reached (a Status or a read
	// found nobody answering): since then, reads of values whose DEK is not cached fail
	// at once.
	UnavailableSince time.Time `json:"unavailableSince,omitzero"`
	// ReportedKeyIDHash is "sha256:<hex>" of the key id the plugin's last healthy Status
	// reported: a key id this apiserver can decrypt. It differs from KeyIDHash while
	// the cluster's write fence holds it back (HeldKeyIDHash).
	ReportedKeyIDHash string `json:"reportedKeyIDHash,omitempty"`
	// HeldKeyIDHash is the key id the write fence holds back, since HeldSince.
	HeldKeyIDHash string    `json:"heldKeyIDHash,omitempty"`
	HeldSince     time.Time `json:"heldSince,omitzero"`
	// FirstSeedHeldUntil is set while the provider holds writes under its first DEK
	// seed (KeyIDHash) until every other apiserver's plugin reports that key id, at the
	// latest until then.
	FirstSeedHeldUntil time.Time `json:"firstSeedHeldUntil,omitzero"`
	// CandidateKeyIDHash is a new key id the plugin reports that does not act yet: it
	// needs more consecutive Status answers (--kms-key-id-confirmations), since
	// CandidateSince.
	CandidateKeyIDHash string    `json:"candidateKeyIDHash,omitempty"`
	CandidateSince     time.Time `json:"candidateSince,omitzero"`
	// ReusedKeyIDHash is a key id the plugin reports again after another one
	// superseded it (a reuse), refused as a write key since ReusedSince.
	ReusedKeyIDHash string    `json:"reusedKeyIDHash,omitempty"`
	ReusedSince     time.Time `json:"reusedSince,omitzero"`
	// KeyIDDisagreements counts the Encrypt answers whose key id differed from the
	// Status key id (not followed); LastKeyIDDisagreement describes the last one.
	KeyIDDisagreements    uint64 `json:"keyIDDisagreements,omitempty"`
	LastKeyIDDisagreement string `json:"lastKeyIDDisagreement,omitempty"`
}

// UncachedKMS marks a read's data context (the etcd key it authenticates): a KMS v2
// provider then asks the plugin to decrypt the stored DEK source, whatever it has
// cached, and caches nothing. It is how a probe learns that a plugin can no longer
// decrypt what is stored under a key id (a deleted key version, an alias re-pointed
// behind a stable key id) while the cached DEKs still serve every read: before the
// cache expires or a restart empties it and the data is unreadable. The mark rides on
// the data context rather than ctx: every read asks for it, and a type assertion costs
// nothing where a lookup in a request's deep context cost 58 ns of a 514 ns read.
type UncachedKMS struct{ value.Context }

// IsUncachedKMS reports whether dataCtx asks for a read past the DEK cache.
func IsUncachedKMS(dataCtx value.Context) bool {
	_, ok := dataCtx.(UncachedKMS)
	return ok
}

// UncachedKMSReads serves tr's transformers with every read marked UncachedKMS.
func UncachedKMSReads(tr value.ResourceTransformers) value.ResourceTransformers {
	return uncachedKMSReads{tr}
}

type uncachedKMSReads struct{ tr value.ResourceTransformers }

func (u uncachedKMSReads) TransformerForResource(gr schema.GroupResource) value.Transformer {
	return uncachedKMSRead{u.tr.TransformerForResource(gr)}
}

type uncachedKMSRead struct{ value.Transformer }

func (r uncachedKMSRead) TransformFromStorage(ctx context.Context, data []byte, dataCtx value.Context) ([]byte, bool, error) {
	return r.Transformer.TransformFromStorage(ctx, data, UncachedKMS{dataCtx})
}
