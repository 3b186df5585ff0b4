// Package wire decodes and encodes the KMS v2 EncryptedObject protobuf stored after the
// k8s:enc:kms:v2:<name>: prefix, byte-compatible with kube-apiserver, without allocating
// on the read path, and validates it exactly as kube-apiserver does.
package wire

import (
	"errors"
	"fmt"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// Limits of a stored EncryptedObject, the same as kube-apiserver's.
const (
	// KeyIDMaxSize is the largest key id a plugin may return.
	KeyIDMaxSize = 1024
	// EncryptedDEKSourceMaxSize is the largest plugin ciphertext of a DEK or seed.
	EncryptedDEKSourceMaxSize = 1024
	// AnnotationsMaxSize bounds Σ(len(key)+len(value)) over all annotations.
	AnnotationsMaxSize = 32 * 1024
)

// SourceType is the EncryptedDEKSourceType of a stored value.
type SourceType uint8

const (
	// SourceAESGCMKey: the plugin encrypted a 32-byte AES-256 key (kube-apiserver ≤1.28 default).
	SourceAESGCMKey SourceType = 0
	// SourceHKDFSeed: the plugin encrypted a 32-byte seed; every value carries a 32-byte
	// HKDF info from which its AES-256-GCM key is derived.
	SourceHKDFSeed SourceType = 1
)

func (t SourceType) String() string {
	switch t {
	case SourceAESGCMKey:
		return "AES_GCM_KEY"
	case SourceHKDFSeed:
		return "HKDF_SHA256_XNONCE_AES_GCM_SEED"
	}
	return fmt.Sprintf("unknown(%d)", uint8(t))
}

// Protobuf field numbers of EncryptedObject (k8s.io/apiserver .../kmsv2/v2/api.proto).
const (
	fieldEncryptedData      = 1
	fieldKeyID              = 2
	fieldEncryptedDEKSource = 3
	fieldAnnotations        = 4
	fieldSourceType         = 5

	mapEntryKey   = 1
	mapEntryValue = 2
)

// MaxInlineAnnotations is a good size for the stack array callers pass to Decode.
const MaxInlineAnnotations = 8

// Annotation is one map entry, aliasing the stored bytes.
type Annotation struct{ Key, Value []byte }

// Object is a decoded EncryptedObject whose byte fields alias the stored value.
type Object struct {
	Data       []byte
	KeyID      []byte
	DEKSource  []byte
	SourceType SourceType
	// tail is everything after a leading field 1, or nil when field 1 does not come
	// first; values we write compare it with the write state's encoded tail.
	Tail []byte
}

var errEmptyValue = errors.New("kms v2: stored value is empty after the prefix (want a protobuf EncryptedObject); the value is truncated or was not written by a KMS v2 provider")

// Decode parses a protobuf EncryptedObject into o and returns its annotations sorted by
// key, appended to buf[:0]; with a stack array as buf (MaxInlineAnnotations) nothing is
// allocated. It validates exactly as kube-apiserver does.
// It never calls the plugin; every error is final for this value.
func Decode(b []byte, o *Object, buf []Annotation) ([]Annotation, error) {
	annos, err := decode(b, o, buf[:0])
	if err != nil {
		return nil, err
	}
	return annos, nil
}

func decode(b []byte, o *Object, annos []Annotation) ([]Annotation, error) {
	*o = Object{}
	if len(b) == 0 {
		return nil, errEmptyValue
	}
	var typ uint64
	first := true
	for len(b) > 0 {
		num, wt, n := protowire.ConsumeTag(b)
		if n < 0 {
			return nil, wireError("field tag", n)
		}
		b = b[n:]
		switch num {
		case fieldEncryptedData, fieldKeyID, fieldEncryptedDEKSource, fieldAnnotations:
			if wt != protowire.BytesType {
				return nil, fmt.Errorf("kms v2: stored EncryptedObject field %d has wire type %d, want bytes; the value is corrupt", num, wt)
			}
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return nil, wireError(fmt.Sprintf("field %d", num), m)
			}
			b = b[m:]
			switch num {
			case fieldEncryptedData:
				o.Data = v
				if first {
					o.Tail = b
				}
			case fieldKeyID:
				o.KeyID = v
			case fieldEncryptedDEKSource:
				o.DEKSource = v
			case fieldAnnotations:
				a, err := decodeAnnotation(v)
				if err != nil {
					return nil, err
				}
				annos = append(annos, a)
			}
		case fieldSourceType:
			if wt != protowire.VarintType {
				return nil, fmt.Errorf("kms v2: stored EncryptedObject field 5 has wire type %d, want varint; the value is corrupt", wt)
			}
			v, m := protowire.ConsumeVarint(b)
			if m < 0 {
				return nil, wireError("field 5", m)
			}
			b = b[m:]
			typ = v
		default:
			// Unknown fields are skipped, as proto.Unmarshal does.
			m := protowire.ConsumeFieldValue(num, wt, b)
			if m < 0 {
				return nil, wireError(fmt.Sprintf("unknown field %d", num), m)
			}
			b = b[m:]
		}
		first = false
	}
	// proto3 enums are int32 on the wire: negative values arrive sign-extended.
	if int32(typ) != int32(SourceAESGCMKey) && int32(typ) != int32(SourceHKDFSeed) {
		return nil, fmt.Errorf("kms v2: failed to validate stored EncryptedObject: unknown encryptedDEKSourceType: %d", int32(typ))
	}
	o.SourceType = SourceType(typ)
	sortAnnotations(annos)
	for i := 1; i < len(annos); i++ {
		if string(annos[i].Key) == string(annos[i-1].Key) {
			return nil, fmt.Errorf("kms v2: stored EncryptedObject repeats annotation %s; the value is corrupt", clip(annos[i].Key))
		}
	}
	return annos, validateObject(o.Data, o.KeyID, o.DEKSource, annos)
}

func decodeAnnotation(b []byte) (Annotation, error) {
	var a Annotation
	for len(b) > 0 {
		num, wt, n := protowire.ConsumeTag(b)
		if n < 0 {
			return a, wireError("annotation tag", n)
		}
		b = b[n:]
		if (num == mapEntryKey || num == mapEntryValue) && wt == protowire.BytesType {
			v, m := protowire.ConsumeBytes(b)
			if m < 0 {
				return a, wireError("annotation", m)
			}
			b = b[m:]
			if num == mapEntryKey {
				a.Key = v
			} else {
				a.Value = v
			}
			continue
		}
		m := protowire.ConsumeFieldValue(num, wt, b)
		if m < 0 {
			return a, wireError("annotation field", m)
		}
		b = b[m:]
	}
	return a, nil
}

func wireError(what string, n int) error {
	return fmt.Errorf("kms v2: stored EncryptedObject is not valid protobuf (%s: %v); the value is truncated or corrupt", what, protowire.ParseError(n))
}

// validateObject applies kube-apiserver's ValidateEncryptedObject rules (the type was
// checked by the caller).
func validateObject(data, keyID, dekSource []byte, annos []Annotation) error {
	if len(data) == 0 {
		return errors.New("kms v2: failed to validate stored EncryptedObject: encrypted data is empty")
	}
	if err := ValidateDEKSource(dekSource); err != nil {
		return fmt.Errorf("kms v2: failed to validate stored EncryptedObject: failed to validate encrypted DEK source: %w", err)
	}
	if _, err := ValidateKeyID(keyID); err != nil {
		return fmt.Errorf("kms v2: failed to validate stored EncryptedObject: failed to validate key id: %w", err)
	}
	if err := ValidateAnnotations(annos); err != nil {
		return fmt.Errorf("kms v2: failed to validate stored EncryptedObject: failed to validate annotations: %w", err)
	}
	return nil
}

func ValidateDEKSource(s []byte) error {
	if len(s) == 0 {
		return errors.New("encrypted DEK source is empty")
	}
	if len(s) > EncryptedDEKSourceMaxSize {
		return fmt.Errorf("encrypted DEK source is %d bytes, which exceeds the max size of %d", len(s), EncryptedDEKSourceMaxSize)
	}
	return nil
}

// Key id validation codes, used as the `error` label of
// apiserver_envelope_encryption_invalid_key_id_from_status_total.
const (
	KeyIDOK      = "ok"
	KeyIDEmpty   = "empty"
	KeyIDTooLong = "too_long"
	KeyIDNotUTF8 = "not_utf8"
)

// ValidateKeyID checks a key id: non-empty, at most KeyIDMaxSize bytes, valid UTF-8 (a
// protobuf string). The returned code labels metrics.
func ValidateKeyID[T string | []byte](keyID T) (string, error) {
	if len(keyID) == 0 {
		return KeyIDEmpty, errors.New("keyID is empty")
	}
	if len(keyID) > KeyIDMaxSize {
		return KeyIDTooLong, fmt.Errorf("keyID is %d bytes, which exceeds the max size of %d", len(keyID), KeyIDMaxSize)
	}
	if !utf8.ValidString(string(keyID)) {
		return KeyIDNotUTF8, errors.New("keyID is not valid UTF-8")
	}
	return KeyIDOK, nil
}

func ValidateAnnotations(annos []Annotation) error {
	total := 0
	var errs []error
	invalid := 0
	for _, a := range annos {
		if err := checkFQDN(a.Key); err != nil {
			// A corrupt or hostile value can carry thousands of bad keys; name a few.
			if invalid < maxEchoedAnnotationErrors {
				errs = append(errs, err)
			}
			invalid++
		}
		total += len(a.Key) + len(a.Value)
	}
	if invalid > maxEchoedAnnotationErrors {
		errs = append(errs, fmt.Errorf("annotations: %d more invalid keys", invalid-maxEchoedAnnotationErrors))
	}
	if total > AnnotationsMaxSize {
		errs = append(errs, fmt.Errorf("total size of annotations is %d, which exceeds the max size of %d", total, AnnotationsMaxSize))
	}
	return errors.Join(errs...)
}

// Bounds of what a validation error echoes of the value it refuses, so that a huge
// annotation does not turn into a multi-megabyte error string on every read.
const (
	maxEchoedBytes            = 64
	maxEchoedAnnotationErrors = 3
)

// clip quotes at most maxEchoedBytes of b and says how long b was when it cut.
func clip(b []byte) string {
	if len(b) <= maxEchoedBytes {
		return fmt.Sprintf("%q", b)
	}
	return fmt.Sprintf("%q… (%d bytes)", b[:maxEchoedBytes], len(b))
}

// checkFQDN is apimachinery's IsFullyQualifiedDomainName without regular expressions or
// allocation on success: an optional trailing dot, a DNS-1123 subdomain (≤253 bytes) of
// at least two DNS-1123 labels (≤63 bytes, [a-z0-9]([-a-z0-9]*[a-z0-9])?).
func checkFQDN(name []byte) error {
	if len(name) == 0 {
		return errors.New("annotations: Required value")
	}
	n := name
	if n[len(n)-1] == '.' {
		n = n[:len(n)-1]
	}
	if len(n) > 253 || len(n) == 0 {
		return fmt.Errorf("annotations: Invalid value: %s: must be a lowercase RFC 1123 subdomain of at most 253 characters", clip(n))
	}
	labels := 0
	start := 0
	for i := 0; i <= len(n); i++ {
		if i < len(n) && n[i] != '.' {
			c := n[i]
			if !(c >= 'a' && c <= 'z' || c >= '0' && c <= '9' || c == '-') {
				return fmt.Errorf("annotations: Invalid value: %s: a lowercase RFC 1123 subdomain must consist of lower case alphanumeric characters, '-' or '.'", clip(n))
			}
			continue
		}
		l := n[start:i]
		if len(l) == 0 || len(l) > 63 || l[0] == '-' || l[len(l)-1] == '-' {
			return fmt.Errorf("annotations: Invalid value: %s: each label must be 1-63 characters and start and end with an alphanumeric character", clip(n))
		}
		labels++
		start = i + 1
	}
	if labels < 2 {
		return fmt.Errorf("annotations: Invalid value: %s: should be a domain with at least two segments separated by dots", clip(n))
	}
	return nil
}

// AppendTail appends the constant part of every value written under one write state:
// fields 2..5 in field-number order with annotations sorted by key, exactly what
// proto.Marshal emits for those fields (map order aside, which readers ignore).
func AppendTail(b []byte, keyID string, dekSource []byte, annos []Annotation, typ SourceType) []byte {
	b = protowire.AppendTag(b, fieldKeyID, protowire.BytesType)
	b = protowire.AppendString(b, keyID)
	b = protowire.AppendTag(b, fieldEncryptedDEKSource, protowire.BytesType)
	b = protowire.AppendBytes(b, dekSource)
	for _, a := range annos {
		entry := 0
		entry += protowire.SizeTag(mapEntryKey) + protowire.SizeBytes(len(a.Key))
		entry += protowire.SizeTag(mapEntryValue) + protowire.SizeBytes(len(a.Value))
		b = protowire.AppendTag(b, fieldAnnotations, protowire.BytesType)
		b = protowire.AppendVarint(b, uint64(entry))
		b = protowire.AppendTag(b, mapEntryKey, protowire.BytesType)
		b = protowire.AppendBytes(b, a.Key)
		b = protowire.AppendTag(b, mapEntryValue, protowire.BytesType)
		b = protowire.AppendBytes(b, a.Value)
	}
	if typ != 0 {
		b = protowire.AppendTag(b, fieldSourceType, protowire.VarintType)
		b = protowire.AppendVarint(b, uint64(typ))
	}
	return b
}
