// Package snapshotfiletest makes etcd-shaped snapshots and damages them, for the tests
// of the snapshot readers: every way a file can be cut short, be garbage, or lie about
// its pages.
package snapshotfiletest

import (
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"math/rand/v2"
	"path/filepath"
	"testing"

	bolt "go.etcd.io/bbolt"
	"go.etcd.io/etcd/api/v3/mvccpb"
	"google.golang.org/protobuf/proto"
)

// bbolt's layout (see ../bolt.go).
const (
	pageHeaderSize = 16
	elementSize    = 16
	metaChecksumAt = 56
	metaRoot       = 16
	metaPgid       = 40
	branchPageFlag = 0x01
	leafPageFlag   = 0x02
	// HashSize is the size of etcd's trailing sha256.
	HashSize = sha256.Size
)

// WithHash is db followed by its sha256, as etcd sends a snapshot.
func WithHash(db []byte) []byte {
	sum := sha256.Sum256(db)
	return append(append([]byte(nil), db...), sum[:]...)
}

// BoltSnapshot makes an etcd-shaped snapshot without etcd: a bbolt database of pages of
// pageSize bytes (0: the OS's) with a "meta" bucket and a "key" bucket of n revisions,
// mvccpb.KeyValues of n/2+1 keys with values of about valueSize bytes, copied out with
// Tx.WriteTo as etcd's Snapshot does, followed by its sha256. Every key is live: n/2+1
// of them.
func BoltSnapshot(tb testing.TB, n, pageSize, valueSize int) []byte {
	tb.Helper()
	db, err := bolt.Open(filepath.Join(tb.TempDir(), "member.db"), 0o600, &bolt.Options{PageSize: pageSize})
	if err != nil {
		tb.Fatal(err)
	}
	defer db.Close()
	err = db.Update(func(tx *bolt.Tx) error {
		if _, err := tx.CreateBucket([]byte("meta")); err != nil {
			return err
		}
		b, err := tx.CreateBucket([]byte("key"))
		if err != nil {
			return err
		}
		for i := 1; i <= n; i++ {
			k := make([]byte, 17)
			binary.BigEndian.PutUint64(k, uint64(i))
			k[8] = '_'
			v, err := proto.Marshal(&mvccpb.KeyValue{
				Key:         fmt.Appendf(nil, "/registry/secrets/default/s%d", i%(n/2+1)),
				Value:       fmt.Appendf(nil, "k8s:enc:aesgcm:v1:key1:%0*d", valueSize, i),
				ModRevision: int64(i), CreateRevision: int64(i), Version: 1,
			})
			if err != nil {
				return err
			}
			if err := b.Put(k, v); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		tb.Fatal(err)
	}
	var w sliceWriter
	if err := db.View(func(tx *bolt.Tx) error { _, err := tx.WriteTo(&w); return err }); err != nil {
		tb.Fatal(err)
	}
	return WithHash(w.b)
}

type sliceWriter struct{ b []byte }

func (w *sliceWriter) Write(p []byte) (int, error) { w.b = append(w.b, p...); return len(p), nil }

// image is a bbolt database in memory, to damage.
type image struct {
	b        []byte
	pageSize int
}

func newImage(db []byte) *image {
	b := append([]byte(nil), db...)
	return &image{b: b, pageSize: int(binary.NativeEndian.Uint32(b[pageHeaderSize+8:]))}
}

func (im *image) page(id uint64) []byte { return im.b[int(id)*im.pageSize:] }
func (im *image) meta(i int) []byte     { return im.b[i*im.pageSize+pageHeaderSize:] }
func (im *image) hwm() uint64           { return binary.NativeEndian.Uint64(im.meta(0)[metaPgid:]) }
func (im *image) root() uint64          { return binary.NativeEndian.Uint64(im.meta(0)[metaRoot:]) }
func (im *image) flags(id uint64) uint16 {
	return binary.NativeEndian.Uint16(im.page(id)[8:])
}
func (im *image) count(id uint64) int { return int(binary.NativeEndian.Uint16(im.page(id)[10:])) }
func (im *image) elem(id uint64, i int) []byte {
	return im.page(id)[pageHeaderSize+i*elementSize:]
}

// setMeta changes a uint64 field at off in both meta pages and fixes their checksums,
// as a hostile writer would.
func (im *image) setMeta(off int, v uint64) {
	for i := 0; i < 2; i++ {
		m := im.meta(i)
		binary.NativeEndian.PutUint64(m[off:], v)
		h := fnv.New64a()
		_, _ = h.Write(m[:metaChecksumAt])
		binary.NativeEndian.PutUint64(m[metaChecksumAt:], h.Sum64())
	}
}

// keyBucket finds the key bucket's entry in the root bucket's leaf page: the value's
// bytes (bucket header first).
func (im *image) keyBucket() ([]byte, error) {
	r := im.root()
	if im.flags(r) != leafPageFlag {
		return nil, fmt.Errorf("root bucket page %d is not a leaf", r)
	}
	for i := 0; i < im.count(r); i++ {
		e := im.elem(r, i)
		pos, ksize := binary.NativeEndian.Uint32(e[4:]), binary.NativeEndian.Uint32(e[8:])
		if string(e[pos:pos+ksize]) == "key" {
			return e[pos+ksize:], nil
		}
	}
	return nil, errors.New("no key bucket in the root page")
}

// branchAndLeaf finds the key bucket's root branch page and its first leaf page.
func (im *image) branchAndLeaf() (branch, leaf uint64, err error) {
	v, err := im.keyBucket()
	if err != nil {
		return 0, 0, err
	}
	branch = binary.NativeEndian.Uint64(v)
	if branch == 0 || im.flags(branch) != branchPageFlag {
		return 0, 0, fmt.Errorf("the key bucket's root %d is not a branch page: make the snapshot bigger", branch)
	}
	leaf = branch
	for depth := 0; im.flags(leaf) == branchPageFlag && depth < 8; depth++ {
		leaf = binary.NativeEndian.Uint64(im.elem(leaf, 0)[8:])
	}
	if im.flags(leaf) != leafPageFlag {
		return 0, 0, fmt.Errorf("no leaf page under the key bucket's root %d", branch)
	}
	return branch, leaf, nil
}

// Corruption is one damaged database.
type Corruption struct {
	Name string
	DB   []byte
}

// Corruptions damages db (a bbolt database without etcd's hash, whose key bucket is a
// branch page over leaf pages) in every way a reader must survive. Each keeps db's
// size, so that a test can give it a valid hash, as a hostile writer would.
func Corruptions(db []byte) ([]Corruption, error) {
	probe := newImage(db)
	hwm := probe.hwm()
	if _, _, err := probe.branchAndLeaf(); err != nil {
		return nil, err
	}
	var out []Corruption
	add := func(name string, change func(im *image)) {
		im := newImage(db)
		change(im)
		out = append(out, Corruption{name, im.b})
	}
	ne := binary.NativeEndian
	branchAndLeaf := func(im *image) (uint64, uint64) {
		b, l, _ := im.branchAndLeaf()
		return b, l
	}
	keyRoot := func(im *image) []byte { v, _ := im.keyBucket(); return v }
	add("meta root page id beyond the end", func(im *image) { im.setMeta(metaRoot, hwm+100) })
	add("meta root page id wild", func(im *image) { im.setMeta(metaRoot, 1<<40) })
	add("meta root page id on a meta page", func(im *image) { im.setMeta(metaRoot, 1) })
	add("meta root page id on the key bucket's branch page", func(im *image) {
		branch, _ := branchAndLeaf(im)
		im.setMeta(metaRoot, branch)
	})
	add("meta high water mark beyond the file", func(im *image) { im.setMeta(metaPgid, hwm*4) })
	add("meta page size zero", func(im *image) {
		for i := 0; i < 2; i++ {
			ne.PutUint32(im.meta(i)[8:], 0)
		}
		im.setMeta(metaRoot, im.root()) // fixes the checksums
	})
	add("both meta pages fail their checksums", func(im *image) {
		im.meta(0)[0] ^= 0xff
		im.meta(1)[0] ^= 0xff
	})
	add("key bucket root page id wild", func(im *image) { ne.PutUint64(keyRoot(im), 1<<40) })
	add("key bucket root page id just beyond the end", func(im *image) { ne.PutUint64(keyRoot(im), hwm) })
	add("branch element page id wild", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint64(im.elem(branch, 0)[8:], 1<<40)
	})
	add("branch element page id just beyond the end", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint64(im.elem(branch, im.count(branch)-1)[8:], hwm+1)
	})
	add("branch element pointing at its own page", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint64(im.elem(branch, im.count(branch)-1)[8:], branch)
	})
	add("branch element pointing at a meta page", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint64(im.elem(branch, 0)[8:], 0)
	})
	add("branch page with no elements", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint16(im.page(branch)[10:], 0)
	})
	add("branch page with 65535 elements", func(im *image) {
		branch, _ := branchAndLeaf(im)
		ne.PutUint16(im.page(branch)[10:], 0xffff)
	})
	add("leaf element key offset wild", func(im *image) {
		_, leaf := branchAndLeaf(im)
		ne.PutUint32(im.elem(leaf, 0)[4:], 0xfffffff0)
	})
	add("leaf element value size wild", func(im *image) {
		_, leaf := branchAndLeaf(im)
		ne.PutUint32(im.elem(leaf, im.count(leaf)-1)[12:], 0x7fffffff)
	})
	add("leaf page overflow wild", func(im *image) {
		_, leaf := branchAndLeaf(im)
		ne.PutUint32(im.page(leaf)[12:], 0xffffffff)
	})
	add("leaf page of another type", func(im *image) {
		_, leaf := branchAndLeaf(im)
		ne.PutUint16(im.page(leaf)[8:], 0x10) // freelist
	})
	add("leaf page saying it is another page", func(im *image) {
		_, leaf := branchAndLeaf(im)
		ne.PutUint64(im.page(leaf)[0:], leaf+1000)
	})
	add("revision keys out of order", func(im *image) {
		_, leaf := branchAndLeaf(im)
		e := im.elem(leaf, 1)
		e[ne.Uint32(e[4:])] = 0xff
	})
	// Random bytes over the data pages, meta pages intact.
	rng := rand.New(rand.NewPCG(1, 2))
	for i := range 3 {
		add(fmt.Sprintf("random data pages %d", i), func(im *image) {
			for j := 2 * im.pageSize; j < len(im.b); j++ {
				im.b[j] = byte(rng.Uint32())
			}
		})
	}
	return out, nil
}

// DamageMeta0 flips meta page 0's magic number, leaving meta page 1 intact: bbolt
// reads such a database from meta page 1.
func DamageMeta0(db []byte) []byte {
	im := newImage(db)
	im.meta(0)[0] ^= 0xff
	return im.b
}

// PageSize is the page size db's meta page 0 gives.
func PageSize(db []byte) int { return newImage(db).pageSize }
