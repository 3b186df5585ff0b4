package aescbc

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"testing"
)

// TestMatchesCryptoCipher compares both directions with crypto/cipher's CBC for every
// key size and many lengths, including in-place encryption.
func TestMatchesCryptoCipher(t *testing.T) {
	for _, keyLen := range []int{16, 24, 32} {
		for trial := 0; trial < 20; trial++ {
			key := random(keyLen)
			c, err := New(key)
			if err != nil {
				t.Fatal(err)
			}
			block, _ := aes.NewCipher(key)
			for _, blocks := range []int{1, 2, 7, 8, 9, 15, 16, 17, 64, 257} {
				iv := random(16)
				pt := random(blocks * 16)
				want := make([]byte, len(pt))
				cipher.NewCBCEncrypter(block, iv).CryptBlocks(want, pt)

				got := bytes.Clone(pt)
				c.Encrypt(iv, got, got) // in place, as the provider does
				if !bytes.Equal(got, want) {
					t.Fatalf("key %d bytes, %d blocks: Encrypt differs from crypto/cipher", keyLen, blocks)
				}
				dec := make([]byte, len(want))
				c.Decrypt(iv, dec, want)
				if !bytes.Equal(dec, pt) {
					t.Fatalf("key %d bytes, %d blocks: Decrypt does not invert crypto/cipher's encryption", keyLen, blocks)
				}
			}
		}
	}
}

func TestFastPathInUse(t *testing.T) {
	c, _ := New(random(32))
	if c.fast == nil {
		t.Skip("CPU without AES-NI or not amd64: crypto/cipher fallback in use")
	}
}

func random(n int) []byte {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return b
}

func BenchmarkDecrypt4KiB(b *testing.B) {
	key := random(32)
	c, _ := New(key)
	block, _ := aes.NewCipher(key)
	iv, ct, out := random(16), random(4096), make([]byte, 4096)
	b.Run("impl=rekey", func(b *testing.B) {
		b.SetBytes(4096)
		for b.Loop() {
			c.Decrypt(iv, out, ct)
		}
	})
	b.Run("impl=crypto-cipher", func(b *testing.B) {
		b.SetBytes(4096)
		for b.Loop() {
			cipher.NewCBCDecrypter(block, iv).CryptBlocks(out, ct)
		}
	})
}

func BenchmarkEncrypt4KiB(b *testing.B) {
	key := random(32)
	c, _ := New(key)
	block, _ := aes.NewCipher(key)
	iv, pt := random(16), random(4096)
	b.Run("impl=rekey", func(b *testing.B) {
		b.SetBytes(4096)
		for b.Loop() {
			c.Encrypt(iv, pt, pt)
		}
	})
	b.Run("impl=crypto-cipher", func(b *testing.B) {
		b.SetBytes(4096)
		for b.Loop() {
			cipher.NewCBCEncrypter(block, iv).CryptBlocks(pt, pt)
		}
	})
}
