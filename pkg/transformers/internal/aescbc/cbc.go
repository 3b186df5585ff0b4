// Package aescbc is AES-CBC for the aescbc provider. On amd64 with AES-NI it encrypts
// without a function call per block and decrypts eight blocks at a time (CBC decryption
// is parallel; Go's crypto/cipher decrypts one block per call on amd64); elsewhere it
// uses crypto/cipher. The bytes are those of crypto/cipher's CBC mode: tests compare the
// two on random keys and inputs for every key size.
package aescbc

import (
	"crypto/aes"
	"crypto/cipher"
	"crypto/subtle"
	"errors"
	"fmt"
)

// BlockSize is the AES block size.
const BlockSize = aes.BlockSize

// Cipher encrypts and decrypts whole blocks in CBC mode with one key.
type Cipher struct {
	fast  *schedule // nil ⇒ use block through crypto/cipher
	block cipher.Block
}

// New returns a CBC cipher for a 16, 24 or 32-byte key.
func New(key []byte) (*Cipher, error) {
	block, err := aes.NewCipher(key)
	if err != nil {
		return nil, fmt.Errorf("aes key must be 16, 24 or 32 bytes, got %d", len(key))
	}
	return &Cipher{block: block, fast: newSchedule(key)}, nil
}

// Encrypt encrypts src into dst (len(src) a multiple of BlockSize, dst may equal src).
func (c *Cipher) Encrypt(iv, dst, src []byte) {
	if len(src)%BlockSize != 0 || len(dst) < len(src) || len(iv) != BlockSize {
		panic("aescbc: bad Encrypt arguments") // programming error: callers size these
	}
	if len(src) == 0 {
		return
	}
	if c.fast != nil {
		encryptCBC(c.fast.rounds, &c.fast.enc[0], &iv[0], &dst[0], &src[0], len(src)/BlockSize)
		return
	}
	cipher.NewCBCEncrypter(c.block, iv).CryptBlocks(dst[:len(src)], src)
}

// Decrypt decrypts src into dst (len(src) a multiple of BlockSize); dst must not
// overlap src.
func (c *Cipher) Decrypt(iv, dst, src []byte) {
	if len(src)%BlockSize != 0 || len(dst) < len(src) || len(iv) != BlockSize {
		panic("aescbc: bad Decrypt arguments")
	}
	if len(src) == 0 {
		return
	}
	if c.fast == nil {
		cipher.NewCBCDecrypter(c.block, iv).CryptBlocks(dst[:len(src)], src)
		return
	}
	decryptBlocks(c.fast.rounds, &c.fast.dec[0], &dst[0], &src[0], len(src)/BlockSize)
	// P_i = D(C_i) ⊕ C_{i-1}, with C_{-1} = IV.
	subtle.XORBytes(dst[:BlockSize], dst[:BlockSize], iv)
	if len(src) > BlockSize {
		subtle.XORBytes(dst[BlockSize:len(src)], dst[BlockSize:len(src)], src[:len(src)-BlockSize])
	}
}

// Errors of Open, in upstream's words (k8s.io/apiserver's aes CBC transformer), so a
// value fails the same way whichever provider stores it.
var (
	ErrShortData    = errors.New("the stored data was shorter than the required size")
	ErrBlockSize    = errors.New("the stored data is not a multiple of the block size")
	ErrInvalidPKCS7 = errors.New("invalid PKCS7 data (empty or not padded)")
	ErrPadding      = errors.New("invalid padding on input (wrong key or corrupted value)")
)

// Open decrypts data = IV(16) ‖ ciphertext and removes its PKCS#7 padding, the stored
// form of upstream's CBC transformer (the aescbc provider, and the data of KMS v1
// values written before Kubernetes 1.25). CBC has no MAC: a wrong key or a corrupted
// value fails only when the garbage it decrypts to is not validly padded.
func (c *Cipher) Open(data []byte) ([]byte, error) {
	if len(data) < BlockSize {
		return nil, ErrShortData
	}
	body := data[BlockSize:]
	if len(body)%BlockSize != 0 {
		return nil, ErrBlockSize
	}
	if len(body) == 0 {
		// Upstream panics here (index out of range); an IV with no ciphertext is simply corrupt.
		return nil, ErrInvalidPKCS7
	}
	out := make([]byte, len(body))
	c.Decrypt(data[:BlockSize], out, body)
	pad := int(out[len(out)-1])
	if pad == 0 || pad > BlockSize || pad > len(out) {
		return nil, ErrInvalidPKCS7
	}
	for _, b := range out[len(out)-pad:] {
		if int(b) != pad {
			return nil, ErrPadding
		}
	}
	return out[:len(out)-pad], nil
}
