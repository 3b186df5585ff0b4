package bench

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
)

// RawGCM is the floor: AES-256-GCM seal/open with one output allocation and a random nonce.
type RawGCM struct{ aead cipher.AEAD }

// NewRawGCM makes a raw AES-256-GCM floor.
func NewRawGCM() *RawGCM {
	k := make([]byte, 32)
	_, _ = rand.Read(k)
	b, _ := aes.NewCipher(k)
	g, _ := cipher.NewGCM(b)
	return &RawGCM{aead: g}
}

// Seal allocates nonce ‖ ciphertext ‖ tag once.
func (r *RawGCM) Seal(pt, aad []byte) []byte {
	out := make([]byte, 12, 12+len(pt)+16)
	_, _ = rand.Read(out)
	return r.aead.Seal(out, out[:12], pt, aad)
}

// Open allocates the plaintext once.
func (r *RawGCM) Open(ct, aad []byte) ([]byte, error) {
	return r.aead.Open(make([]byte, 0, len(ct)-28), ct[:12], ct[12:], aad)
}
