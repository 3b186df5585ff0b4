package snapshotfile

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"io"
)

// bbolt (go.etcd.io/bbolt v1.5) reads its file through a memory map and follows page
// ids, element offsets and element counts read from the file through unsafe pointers,
// without bounds checks: a wild page id or offset makes it read outside the map (SIGSEGV),
// past the end of the file inside the map (SIGBUS), or loop on a page that references
// itself. Those are runtime faults, not errors and not panics: nothing in the process
// can recover from them. bbolt's own consistency check (Tx.Check) follows the same
// unsafe pointers (in a goroutine of its own), so it faults on the same files.
//
// validateBolt therefore checks, before bbolt is given the file, everything bbolt
// touches to find and walk etcd's "key" bucket, with ordinary bounds-checked reads:
// the meta pages (magic, version, checksum, page size, root and freelist page ids below
// the high water mark, a file long enough for that mark), and every page of the root
// bucket's tree and of the key bucket's tree (inside the file, each reached once, branch
// or leaf, elements and their keys and values inside the page, revision keys in order).
// bbolt itself then runs in a child process (reader.go), so that a fault this check did
// not foresee ends that process, not rekey.
//
// The layout, from go.etcd.io/bbolt/internal/common (fields in the host's byte order,
// as bbolt writes them through unsafe casts):
//
//	page:            id u64 | flags u16 | count u16 | overflow u32 | elements…
//	meta (page 0,1): magic u32 | version u32 | pageSize u32 | flags u32 | root u64 |
//	                 sequence u64 | freelist u64 | pgid (high water mark) u64 | txid u64 |
//	                 checksum u64 (FNV-64a of the 56 bytes before it)
//	branch element:  pos u32 | ksize u32 | pgid u64   (key at element + pos)
//	leaf element:    flags u32 | pos u32 | ksize u32 | vsize u32   (key, then value, at element + pos)
//	bucket value:    root u64 | sequence u64 | (root 0: an inline leaf page)
const (
	boltMagic        = 0xED0CDAED
	boltVersion      = 2
	pageHeaderSize   = 16
	metaSize         = 64
	metaChecksumAt   = 56
	elementSize      = 16
	branchPageFlag   = 0x01
	leafPageFlag     = 0x02
	bucketLeafFlag   = 0x01
	bucketHeaderSize = 16
	noFreelist       = ^uint64(0)
	firstDataPage    = 2 // pages 0 and 1 are the meta pages
	// bbolt looks for the second meta page at 1 KiB … 16 MiB; etcd uses the OS page size.
	minPageSize = 1 << 10
	maxPageSize = 1 << 24
	// maxPageSpan bounds one page with its overflow pages (a leaf holding one large
	// value): etcd refuses requests above its --max-request-bytes (1.5 MiB by default),
	// so a span this large is a corrupt overflow count, and reading it would be a
	// memory bomb.
	maxPageSpan = 256 << 20
	// maxTreeDepth bounds a bucket's tree: every page but the root holds at least two
	// elements, so a file of 2^64 pages is less deep.
	maxTreeDepth = 64
)

// boltMeta is a decoded meta page.
type boltMeta struct {
	magic, version, pageSize uint32
	root, freelist, hwm      uint64
	txid, checksum, sum      uint64
}

func (m boltMeta) problem() string {
	switch {
	case m.magic != boltMagic:
		return "not a bbolt database (no bbolt magic number)"
	case m.version != boltVersion:
		return fmt.Sprintf("a bbolt database of format version %d, not %d", m.version, boltVersion)
	case m.checksum != m.sum:
		return "a meta page that fails its checksum"
	}
	return ""
}

// readMeta decodes the meta page at offset off, ok false when the file is too short.
func readMeta(r io.ReaderAt, size, off int64) (m boltMeta, ok bool) {
	if off < 0 || off+pageHeaderSize+metaSize > size {
		return m, false
	}
	var buf [pageHeaderSize + metaSize]byte
	if _, err := r.ReadAt(buf[:], off); err != nil {
		return m, false
	}
	b := buf[pageHeaderSize:]
	ne := binary.NativeEndian
	m.magic = ne.Uint32(b[0:])
	m.version = ne.Uint32(b[4:])
	m.pageSize = ne.Uint32(b[8:])
	m.root = ne.Uint64(b[16:])
	m.freelist = ne.Uint64(b[32:])
	m.hwm = ne.Uint64(b[40:])
	m.txid = ne.Uint64(b[48:])
	m.checksum = ne.Uint64(b[metaChecksumAt:])
	h := fnv.New64a()
	_, _ = h.Write(b[:metaChecksumAt])
	m.sum = h.Sum64()
	return m, true
}

// validateBolt checks the bbolt database of size bytes in r the way bbolt will read
// it to walk etcd's key bucket; the error says what is wrong, in words for a person.
func validateBolt(r io.ReaderAt, size int64) error {
	if size < 2*minPageSize {
		return fmt.Errorf("it is %d bytes long, shorter than the two meta pages a bbolt database starts with", size)
	}
	// The page size: meta page 0's, else that of a valid meta page 1 found by trying
	// every page size bbolt tries (bbolt's getPageSize).
	m0, _ := readMeta(r, size, 0)
	pageSize := int64(m0.pageSize)
	if m0.problem() != "" {
		pageSize = 0
		for i := 0; i <= 14; i++ {
			off := int64(minPageSize) << i
			if off >= size-minPageSize {
				break
			}
			if m, ok := readMeta(r, size, off); ok && m.problem() == "" {
				pageSize = int64(m.pageSize)
				break
			}
		}
		if pageSize == 0 {
			return fmt.Errorf("it is %s, and no second meta page stands in for the first", m0.problem())
		}
	}
	if pageSize < minPageSize || pageSize > maxPageSize || pageSize&(pageSize-1) != 0 {
		return fmt.Errorf("its meta page gives a page size of %d bytes, not a power of two from %d to %d", pageSize, minPageSize, maxPageSize)
	}
	if size < 2*pageSize {
		return fmt.Errorf("it is %d bytes long, shorter than its two meta pages of %d bytes: it was cut short", size, pageSize)
	}
	m1, _ := readMeta(r, size, pageSize)
	// The meta bbolt uses: the valid one of the higher transaction id (bbolt's DB.meta).
	a, b := m0, m1
	if m1.txid > m0.txid {
		a, b = m1, m0
	}
	m := a
	if a.problem() != "" {
		m = b
	}
	if p := m.problem(); p != "" {
		return fmt.Errorf("both of its meta pages are invalid (%s)", p)
	}
	pages := uint64(size / pageSize)
	if m.hwm > pages {
		return fmt.Errorf("its meta page counts %d pages of %d bytes, but it has %d bytes (%d pages): it was cut short", m.hwm, pageSize, size, pages)
	}
	if m.root < firstDataPage || m.root >= m.hwm {
		return fmt.Errorf("its meta page puts the root bucket at page %d, outside its pages %d…%d", m.root, firstDataPage, int64(m.hwm)-1)
	}
	if m.freelist != noFreelist && (m.freelist < firstDataPage || m.freelist >= m.hwm) {
		return fmt.Errorf("its meta page puts the freelist at page %d, outside its pages %d…%d", m.freelist, firstDataPage, int64(m.hwm)-1)
	}
	w := &walker{r: r, pageSize: uint64(pageSize), hwm: m.hwm, seen: make([]uint64, (m.hwm+63)/64)}
	var keyEntry []byte
	err := w.tree(m.root, 0, "the root bucket", func(flags uint32, k, v []byte) error {
		if flags&bucketLeafFlag != 0 && string(k) == keyBucket && keyEntry == nil {
			keyEntry = bytes.Clone(v)
		}
		return nil
	})
	if err != nil {
		return err
	}
	if keyEntry == nil {
		return errors.New(`it has no "key" bucket`)
	}
	return w.bucket(keyEntry)
}

// walker reads the pages of one database once each.
type walker struct {
	r        io.ReaderAt
	pageSize uint64
	hwm      uint64
	seen     []uint64 // one bit per page: reached already
	lastKey  []byte
}

// page reads page id with its overflow pages.
func (w *walker) page(id uint64, where string) ([]byte, error) {
	if id < firstDataPage || id >= w.hwm {
		return nil, fmt.Errorf("%s refers to page %d, outside its pages %d…%d", where, id, firstDataPage, int64(w.hwm)-1)
	}
	var hdr [pageHeaderSize]byte
	if _, err := w.r.ReadAt(hdr[:], int64(id*w.pageSize)); err != nil {
		return nil, fmt.Errorf("reading page %d: %w", id, err)
	}
	ne := binary.NativeEndian
	if self := ne.Uint64(hdr[0:]); self != id {
		return nil, fmt.Errorf("%s refers to page %d, which says it is page %d", where, id, self)
	}
	overflow := uint64(ne.Uint32(hdr[12:]))
	if id+overflow >= w.hwm {
		return nil, fmt.Errorf("page %d runs %d pages past its last page %d", id, id+overflow-w.hwm+1, w.hwm-1)
	}
	span := (overflow + 1) * w.pageSize
	if span > maxPageSpan {
		return nil, fmt.Errorf("page %d spans %d bytes, more than any etcd value needs (%d)", id, span, maxPageSpan)
	}
	for p := id; p <= id+overflow; p++ {
		word, bit := p/64, uint64(1)<<(p%64)
		if w.seen[word]&bit != 0 {
			return nil, fmt.Errorf("%s refers to page %d, which is reached twice (a cycle or a shared page)", where, p)
		}
		w.seen[word] |= bit
	}
	buf := make([]byte, span)
	if _, err := w.r.ReadAt(buf, int64(id*w.pageSize)); err != nil {
		return nil, fmt.Errorf("reading page %d: %w", id, err)
	}
	return buf, nil
}

// tree walks the tree of pages under page id in key order, calling leaf for every leaf
// element.
func (w *walker) tree(id uint64, depth int, where string, leaf func(flags uint32, k, v []byte) error) error {
	if depth > maxTreeDepth {
		return fmt.Errorf("%s is a tree deeper than %d pages", where, maxTreeDepth)
	}
	p, err := w.page(id, where)
	if err != nil {
		return err
	}
	return w.node(p, fmt.Sprintf("page %d", id), depth, leaf)
}

// node checks one page p (or an inline page) and walks under it.
func (w *walker) node(p []byte, name string, depth int, leaf func(flags uint32, k, v []byte) error) error {
	if len(p) < pageHeaderSize {
		return fmt.Errorf("%s is %d bytes, shorter than a page header", name, len(p))
	}
	ne := binary.NativeEndian
	flags, count := ne.Uint16(p[8:]), uint64(ne.Uint16(p[10:]))
	if flags != branchPageFlag && flags != leafPageFlag {
		return fmt.Errorf("%s has page flags %#x where a branch or leaf page belongs", name, flags)
	}
	size := uint64(len(p))
	if pageHeaderSize+count*elementSize > size {
		return fmt.Errorf("%s claims %d elements, more than fit in its %d bytes", name, count, size)
	}
	if flags == branchPageFlag && count == 0 {
		return fmt.Errorf("%s is a branch page with no elements", name)
	}
	for i := uint64(0); i < count; i++ {
		at := pageHeaderSize + i*elementSize
		e := p[at : at+elementSize]
		if flags == branchPageFlag {
			pos, ksize := uint64(ne.Uint32(e[0:])), uint64(ne.Uint32(e[4:]))
			if at+pos+ksize > size {
				return fmt.Errorf("%s: element %d has its key outside the page", name, i)
			}
			if err := w.tree(ne.Uint64(e[8:]), depth+1, fmt.Sprintf("%s (element %d)", name, i), leaf); err != nil {
				return err
			}
			continue
		}
		eflags := ne.Uint32(e[0:])
		pos, ksize, vsize := uint64(ne.Uint32(e[4:])), uint64(ne.Uint32(e[8:])), uint64(ne.Uint32(e[12:]))
		if eflags&^bucketLeafFlag != 0 {
			return fmt.Errorf("%s: element %d has flags %#x", name, i, eflags)
		}
		if at+pos+ksize+vsize > size {
			return fmt.Errorf("%s: element %d has its key or value outside the page", name, i)
		}
		k := p[at+pos : at+pos+ksize]
		v := p[at+pos+ksize : at+pos+ksize+vsize]
		if err := leaf(eflags, k, v); err != nil {
			return fmt.Errorf("%s: element %d: %w", name, i, err)
		}
	}
	return nil
}

// bucket walks etcd's key bucket, whose bucket value is v.
func (w *walker) bucket(v []byte) error {
	if len(v) < bucketHeaderSize {
		return fmt.Errorf(`its "key" bucket's entry is %d bytes, shorter than a bucket header`, len(v))
	}
	root := binary.NativeEndian.Uint64(v)
	if root == 0 {
		inline := v[bucketHeaderSize:]
		if len(inline) >= pageHeaderSize && binary.NativeEndian.Uint16(inline[8:]) != leafPageFlag {
			return errors.New(`its "key" bucket is an inline page that is not a leaf page`)
		}
		return w.node(inline, `the "key" bucket's inline page`, 0, w.revision)
	}
	return w.tree(root, 0, `the "key" bucket`, w.revision)
}

// revision checks one element of the key bucket: a revision key, in order, no bucket.
func (w *walker) revision(flags uint32, k, _ []byte) error {
	if flags&bucketLeafFlag != 0 {
		return errors.New(`the "key" bucket holds a nested bucket`)
	}
	if len(k) != revBytesLen && len(k) != markedRevLen {
		return fmt.Errorf("a revision key of %d bytes", len(k))
	}
	if w.lastKey != nil && bytes.Compare(k, w.lastKey) <= 0 {
		return errors.New("revision keys out of order")
	}
	w.lastKey = append(w.lastKey[:0], k...)
	return nil
}
