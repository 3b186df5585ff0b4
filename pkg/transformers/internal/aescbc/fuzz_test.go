package aescbc

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"testing"
)

// FuzzMatchesCryptoCipher is differential: for any key (16, 24 or 32 bytes, chosen by
// the input), IV and plaintext, Encrypt and Decrypt must produce exactly the bytes of
// crypto/cipher's CBC mode, and Decrypt must undo Encrypt — on the amd64 fast path as
// elsewhere.
func FuzzMatchesCryptoCipher(f *testing.F) {
	f.Add(uint8(0), bytes.Repeat([]byte{1}, 32), bytes.Repeat([]byte{2}, 16), []byte("sixteen byte msg"))
	f.Add(uint8(1), bytes.Repeat([]byte{3}, 32), make([]byte, 16), bytes.Repeat([]byte{0xa5}, 16*9))
	f.Add(uint8(2), make([]byte, 32), make([]byte, 16), bytes.Repeat([]byte{0}, 16*17))
	f.Fuzz(func(t *testing.T, sizeSel uint8, keyMaterial, iv, plaintext []byte) {
		size := []int{16, 24, 32}[int(sizeSel)%3]
		key := make([]byte, size)
		copy(key, keyMaterial)
		ivb := make([]byte, BlockSize)
		copy(ivb, iv)
		ivCopy := bytes.Clone(ivb)
		plaintext = plaintext[:len(plaintext)/BlockSize*BlockSize]
		if len(plaintext) > 64<<10 {
			plaintext = plaintext[:64<<10]
		}

		c, err := New(key)
		if err != nil {
			t.Fatalf("New with a %d-byte key: %v", size, err)
		}
		block, err := aes.NewCipher(key)
		if err != nil {
			t.Fatal(err)
		}

		got := make([]byte, len(plaintext))
		c.Encrypt(ivb, got, plaintext)
		want := make([]byte, len(plaintext))
		cipher.NewCBCEncrypter(block, ivb).CryptBlocks(want, plaintext)
		if !bytes.Equal(got, want) {
			t.Fatalf("Encrypt differs from crypto/cipher (key %d bytes, %d bytes)", size, len(plaintext))
		}
		inPlace := bytes.Clone(plaintext)
		c.Encrypt(ivb, inPlace, inPlace)
		if !bytes.Equal(inPlace, want) {
			t.Fatal("in-place Encrypt differs from crypto/cipher")
		}

		back := make([]byte, len(want))
		c.Decrypt(ivb, back, want)
		if !bytes.Equal(back, plaintext) {
			t.Fatal("Decrypt does not undo Encrypt")
		}
		// Decrypting arbitrary bytes (a wrong key, corrupt data) must match too.
		ref := make([]byte, len(plaintext))
		cipher.NewCBCDecrypter(block, ivb).CryptBlocks(ref, plaintext)
		dec := make([]byte, len(plaintext))
		c.Decrypt(ivb, dec, plaintext)
		if !bytes.Equal(dec, ref) {
			t.Fatalf("Decrypt differs from crypto/cipher (key %d bytes, %d bytes)", size, len(plaintext))
		}
		if !bytes.Equal(ivb, ivCopy) {
			t.Fatal("the IV was modified")
		}
	})
}
