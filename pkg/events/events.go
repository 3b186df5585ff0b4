// Package events is the one hook through which the rest of rekey reports what an
// operator should see in `kubectl get events`: a write key held or promoted, a
// straggler, a key conflict, a guard refusal, a KMS key id change, a migration
// started, verified or failed, a configuration applied or refused, a key dropped.
//
// It imports nothing of rekey, so every package that reports (pkg/reload, pkg/cluster,
// pkg/layer) can take a Sink through its options; the default is Nop. pkg/layer wires
// a client-go event recorder to a Deferred once the apiserver's loopback client
// exists. Messages hold no key material: keys by provider/name and check value, KMS
// key ids as their sha256: hash.
package events

import "sync"

// Kind is the Kubernetes event type.
type Kind string

const (
	Normal  Kind = "Normal"
	Warning Kind = "Warning"
)

// Sink receives events. Event must not block: it runs on reload, fence and migration
// paths.
type Sink interface {
	Event(kind Kind, reason, message string)
}

// Nop drops every event: the default where no Sink is given.
type Nop struct{}

func (Nop) Event(Kind, string, string) {}

// OrNop is s, or Nop when s is nil.
func OrNop(s Sink) Sink {
	if s == nil {
		return Nop{}
	}
	return s
}

// Reasons, one per fact (CamelCase, as Kubernetes event reasons are).
const (
	ReasonConfigApplied     = "EncryptionConfigApplied"
	ReasonConfigRefused     = "EncryptionConfigRefused"
	ReasonGuardRefused      = "KeyInUseGuardRefused"
	ReasonKeyDropped        = "EncryptionKeyDropped"
	ReasonWriteKeyHeld      = "WriteKeyHeld"
	ReasonWriteKeyPromoted  = "WriteKeyPromoted"
	ReasonWritesRefused     = "WritesRefused"
	ReasonStraggler         = "EncryptionStraggler"
	ReasonKeyConflict       = "EncryptionKeyConflict"
	ReasonDisagreement      = "WriteKeyDisagreement"
	ReasonKMSKeyIDChanged   = "KMSKeyIDChanged"
	ReasonMigrationStarted  = "StorageMigrationStarted"
	ReasonMigrationVerified = "StorageMigrationVerified"
	ReasonMigrationFailed   = "StorageMigrationFailed"

	// ReasonKMSKeyIDReused: a KMS plugin reports a superseded key id again; refused.
	ReasonKMSKeyIDReused = "KMSKeyIDReused"
	// ReasonKMSKeyIDDisagreement: a KMS plugin's Encrypt and Status key ids differ.
	ReasonKMSKeyIDDisagreement = "KMSKeyIDDisagreement"
	// ReasonKMSDecryptProbeFailed: a KMS plugin answered but could not decrypt a stored
	// object's DEK under a key id data is stored with.
	ReasonKMSDecryptProbeFailed = "KMSDecryptProbeFailed"
)

// DefaultBuffer is how many events a Deferred keeps before it is attached.
const DefaultBuffer = 64

type event struct {
	kind            Kind
	reason, message string
}

// Deferred is a Sink for events that happen before their destination exists (an
// apiserver's recorder needs its loopback client, which serves only after start-up,
// while the first configuration is applied before): it keeps the first Max events and
// counts the rest, then hands them to the Sink given to Attach, in order.
type Deferred struct {
	// Max bounds the buffer; zero means DefaultBuffer.
	Max int

	mu      sync.Mutex
	sink    Sink
	buf     []event
	dropped int
}

// Event forwards to the attached Sink, or buffers.
func (d *Deferred) Event(kind Kind, reason, message string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if d.sink != nil {
		d.sink.Event(kind, reason, message)
		return
	}
	max := d.Max
	if max <= 0 {
		max = DefaultBuffer
	}
	if len(d.buf) >= max {
		d.dropped++
		return
	}
	d.buf = append(d.buf, event{kind, reason, message})
}

// Attach sends the buffered events to s and every later one; it returns how many were
// dropped because the buffer was full. Attach(nil) detaches (events are buffered
// again), e.g. when the recorder shuts down.
func (d *Deferred) Attach(s Sink) (dropped int) {
	d.mu.Lock()
	defer d.mu.Unlock()
	d.sink = s
	if s == nil {
		return 0
	}
	for _, e := range d.buf {
		s.Event(e.kind, e.reason, e.message)
	}
	dropped, d.buf, d.dropped = d.dropped, nil, 0
	return dropped
}
