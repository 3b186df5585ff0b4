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
