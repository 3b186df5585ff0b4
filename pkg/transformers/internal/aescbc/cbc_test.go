package aescbc

import (
	"bytes"
	"crypto/aes"
	"crypto/cipher"
	"crypto/rand"
	"strings"
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

// TestOpenFailsWithOneError: whatever is wrong with a value — too short, a length that
// is no multiple of the block, an IV alone, a last byte of 0 or above 16, padding bytes
// that disagree — Open fails with ErrOpen and nothing else, so no answer tells a bad
// padding from a bad length (a padding oracle). Validly padded values open.
func TestOpenFailsWithOneError(t *testing.T) {
	c, err := New(random(32))
	if err != nil {
		t.Fatal(err)
	}
	// seal encrypts whole blocks as they are (no padding added): IV ‖ ciphertext.
	seal := func(plain []byte) []byte {
		iv := random(BlockSize)
		out := append(bytes.Clone(iv), plain...)
		c.Encrypt(iv, out[BlockSize:], out[BlockSize:])
		return out
	}
	// ending is a block of 'p' that ends with tail.
	ending := func(tail ...byte) []byte {
		b := bytes.Repeat([]byte{'p'}, BlockSize)
		copy(b[BlockSize-len(tail):], tail)
		return b
	}
	for name, data := range map[string][]byte{
		"empty":                          {},
		"shorter than an IV":             random(BlockSize - 1),
		"an IV alone":                    random(BlockSize),
		"not a multiple of the block":    random(2*BlockSize + 1),
		"last byte 0":                    seal(ending(0)),
		"last byte 17":                   seal(ending(17)),
		"last byte 255":                  seal(ending(255)),
		"padding bytes disagree":         seal(ending(1, 3, 3)),
		"a full block of padding, wrong": seal(append([]byte{15}, bytes.Repeat([]byte{16}, 15)...)),
		"padding in an earlier block":    seal(append(bytes.Repeat([]byte{16}, 16), ending(0)...)),
	} {
		out, err := c.Open(data)
		if out != nil || err != ErrOpen {
			t.Errorf("%s: Open = %q, %v; want nil, ErrOpen", name, out, err)
		}
	}
	for _, tc := range []struct {
		plain []byte
		want  string
	}{
		{ending(3, 3, 3), "ppppppppppppp"},
		{bytes.Repeat([]byte{16}, 16), ""},
		{append(ending('x'), bytes.Repeat([]byte{16}, 16)...), strings.Repeat("p", 15) + "x"},
	} {
		out, err := c.Open(seal(tc.plain))
		if err != nil || string(out) != tc.want {
			t.Errorf("Open of %q = %q, %v; want %q", tc.plain, out, err, tc.want)
		}
	}
}

// TestUnpadMatchesItsDefinition: the constant-time padding check agrees with the plain
// definition of PKCS#7 for every last byte, with every byte of the block (or none)
// made wrong.
func TestUnpadMatchesItsDefinition(t *testing.T) {
	reference := func(last []byte) (int, bool) {
		n := int(last[BlockSize-1])
		if n == 0 || n > BlockSize {
			return n, false
		}
		for _, b := range last[BlockSize-n:] {
			if int(b) != n {
				return n, false
			}
		}
		return n, true
	}
	valid := 0
	for pad := 0; pad < 256; pad++ {
		for wrong := -1; wrong < BlockSize-1; wrong++ {
			last := random(BlockSize)
			for i := BlockSize - min(pad, BlockSize); i < BlockSize; i++ {
				last[i] = byte(pad)
			}
			if wrong >= 0 {
				last[wrong] ^= 0x40
			}
			wantN, wantOK := reference(last)
			gotN, gotOK := unpad(last)
			if gotOK != wantOK || gotOK && gotN != wantN {
				t.Fatalf("unpad(% x) = %d, %v; want %d, %v", last, gotN, gotOK, wantN, wantOK)
			}
			if gotOK {
				valid++
			}
		}
	}
	if valid == 0 {
		t.Fatal("no block was validly padded: the test checks nothing")
	}
}
