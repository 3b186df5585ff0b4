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

// ErrOpen is the one error of Open, whatever failed: the length of the data or its
// padding. CBC has no MAC, so an answer that told a bad padding from a bad length (or
// took longer for one than the other) would let whoever can write stored values and
// watch reads decrypt them a byte at a time (a padding oracle). The length of stored
// data is no secret, but one error for everything leaves nothing to compare.
var ErrOpen = errors.New("the stored data does not decrypt as AES-CBC (wrong key, corrupted value, or not an AES-CBC value)")

// Open decrypts data = IV(16) ‖ ciphertext and removes its PKCS#7 padding, the stored
// form of upstream's CBC transformer (the aescbc provider, and the data of KMS v1
// values written before Kubernetes 1.25). CBC has no MAC: a wrong key or a corrupted
// value fails only when the garbage it decrypts to is not validly padded. Every
// failure is ErrOpen, and the padding is checked in constant time.
func (c *Cipher) Open(data []byte) ([]byte, error) {
	if len(data) < 2*BlockSize || len(data)%BlockSize != 0 {
		// An IV and no ciphertext (upstream panics there), a short or a ragged value.
		return nil, ErrOpen
	}
	body := data[BlockSize:]
	out := make([]byte, len(body))
	c.Decrypt(data[:BlockSize], out, body)
	pad, ok := unpad(out[len(out)-BlockSize:])
	if !ok {
		clear(out)
		return nil, ErrOpen
	}
	return out[:len(out)-pad], nil
}

// unpad checks the PKCS#7 padding of last, the final block, in constant time: its last
// byte n must be 1..BlockSize and the n bytes that end the block must all be n.
func unpad(last []byte) (n int, ok bool) {
	pad := last[BlockSize-1]
	good := subtle.ConstantTimeLessOrEq(1, int(pad)) & subtle.ConstantTimeLessOrEq(int(pad), BlockSize)
	for i := 0; i < BlockSize; i++ {
		// Bytes within the padding (BlockSize-i <= pad) must equal pad.
		inPad := subtle.ConstantTimeLessOrEq(BlockSize-i, int(pad))
		same := subtle.ConstantTimeByteEq(last[i], pad)
		good &= subtle.ConstantTimeSelect(inPad, same, 1)
	}
	return int(pad), good == 1
}
