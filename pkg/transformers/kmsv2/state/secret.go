package state

import (
	"fmt"
	"strconv"
)

// Secret is plaintext key material (a DEK seed or key). It is a []byte everywhere it is
// used, but every way of printing or serialising it — fmt's verbs, %v of a struct
// holding it, json.Marshal — shows only its length, so a future log line or debug dump
// of a WriteState or EncryptResult cannot leak it. The methods do not allocate on the
// data path: nothing formats a Secret there.
type Secret []byte

// redacted is what every rendering shows: the length only.
func (s Secret) redacted() string {
	return "<redacted " + strconv.Itoa(len(s)) + " bytes>"
}

// String implements fmt.Stringer.
func (s Secret) String() string { return s.redacted() }

// GoString implements fmt.GoStringer (%#v).
func (s Secret) GoString() string { return "state.Secret(" + s.redacted() + ")" }

// Format implements fmt.Formatter, so %x, %X, %q, %d and %s cannot reach the bytes.
func (s Secret) Format(f fmt.State, verb rune) {
	switch {
	case verb == 'v' && f.Flag('#'):
		_, _ = f.Write([]byte(s.GoString()))
	case verb == 'q':
		_, _ = f.Write([]byte(strconv.Quote(s.redacted())))
	default:
		_, _ = f.Write([]byte(s.redacted()))
	}
}

// MarshalJSON implements json.Marshaler.
func (s Secret) MarshalJSON() ([]byte, error) { return []byte(strconv.Quote(s.redacted())), nil }

// MarshalText implements encoding.TextMarshaler (YAML, text encoders, map keys).
func (s Secret) MarshalText() ([]byte, error) { return []byte(s.redacted()), nil }

// Format implements fmt.Formatter. Printing a *WriteState with a verb that does not fit
// a pointer (%s, %q, %x) makes fmt fall back to a raw dump that skips Secret's methods;
// formatting the fields through a method-less copy of the type keeps every verb on
// Secret's redacting Format.
func (w WriteState) Format(f fmt.State, verb rune) {
	type writeState WriteState
	fmt.Fprintf(f, fmt.FormatString(f, verb), writeState(w))
}

// Format implements fmt.Formatter; see WriteState.Format.
func (e EncryptResult) Format(f fmt.State, verb rune) {
	type encryptResult EncryptResult
	fmt.Fprintf(f, fmt.FormatString(f, verb), encryptResult(e))
}
