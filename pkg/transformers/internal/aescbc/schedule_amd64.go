package aescbc

import (
	"encoding/binary"

	"golang.org/x/sys/cpu"
)

// schedule holds expanded round keys in the byte order AES-NI loads them.
type schedule struct {
	rounds int
	enc    [15 * 16]byte
	dec    [15 * 16]byte // equivalent inverse cipher keys, for AESDEC
}

var rcon = [...]uint32{0x01, 0x02, 0x04, 0x08, 0x10, 0x20, 0x40, 0x80, 0x1b, 0x36}

// newSchedule expands key with AESKEYGENASSIST (constant time: no table lookups that
// depend on the key). nil when the CPU lacks AES-NI.
func newSchedule(key []byte) *schedule {
	if !cpu.X86.HasAES || !cpu.X86.HasSSE41 {
		return nil
	}
	nk := len(key) / 4
	s := &schedule{rounds: nk + 6}
	n := 4 * (s.rounds + 1)
	var w [60]uint32
	for i := 0; i < nk; i++ {
		w[i] = binary.BigEndian.Uint32(key[4*i:])
	}
	for i := nk; i < n; i++ {
		t := w[i-1]
		switch {
		case i%nk == 0:
			t = subWord(t<<8|t>>24) ^ rcon[i/nk-1]<<24
		case nk > 6 && i%nk == 4:
			t = subWord(t)
		}
		w[i] = w[i-nk] ^ t
	}
	for i := 0; i < n; i++ {
		binary.BigEndian.PutUint32(s.enc[4*i:], w[i])
	}
	// dec[0] = enc[Nr], dec[r] = InvMixColumns(enc[Nr-r]), dec[Nr] = enc[0].
	copy(s.dec[0:16], s.enc[16*s.rounds:16*s.rounds+16])
	for r := 1; r < s.rounds; r++ {
		invMixColumns(&s.dec[16*r], &s.enc[16*(s.rounds-r)])
	}
	copy(s.dec[16*s.rounds:16*s.rounds+16], s.enc[0:16])
	return s
}

// Implemented in cbc_amd64.s.

//go:noescape
func subWord(w uint32) uint32

//go:noescape
func invMixColumns(dst, src *byte)

//go:noescape
func encryptCBC(rounds int, xk, iv, dst, src *byte, blocks int)

//go:noescape
func decryptBlocks(rounds int, xk, dst, src *byte, blocks int)
