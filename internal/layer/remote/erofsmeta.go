package remote

import (
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sort"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// The EROFS on-disk format, as far as finding an image's metadata needs
// it (the kernel's fs/erofs/erofs_fs.h): the superblock, inodes (compact
// or extended), their xattrs and inline tails, and directory blocks.
const (
	erofsSuperOffset = 1024
	erofsMagic       = 0xE0F5E1E2
	erofsSlotSize    = 32 // nids count 32-byte slots from meta_blkaddr

	erofsLayoutFlatPlain  = 0
	erofsLayoutFlatInline = 2
	erofsLayoutChunkBased = 4

	erofsDirentSize = 12

	// erofsMaxWalk bounds the inodes a walk visits (the layer store's
	// file limit with room to spare) so that a crafted image cannot keep
	// it going; a cycle of directories is caught by the visited set.
	erofsMaxWalk = 4_000_000
)

// Range is a byte range [Off, Off+Len) of an image.
type Range struct {
	Off, Len int64
}

// MetadataRanges returns where an EROFS image's metadata lies: the
// superblock, every inode reachable from the root with its xattrs and
// what follows it inline (a tail, a chunk table), and every directory's
// blocks; sorted and merged. File data is left out. r is the image, size
// its length; a malformed image is errdefs.ErrInvalid.
//
// Compressed files' data is left out too: their extent maps follow the
// inode (counted) and point into data blocks.
func MetadataRanges(r io.ReaderAt, size int64) ([]Range, error) {
	sb := make([]byte, 128)
	if _, err := r.ReadAt(sb, erofsSuperOffset); err != nil {
		return nil, errdefs.Invalid("reading EROFS superblock: %v", err)
	}
	if binary.LittleEndian.Uint32(sb[0:]) != erofsMagic {
		return nil, errdefs.Invalid("not an EROFS image (magic %#x)", binary.LittleEndian.Uint32(sb[0:]))
	}
	blkbits := sb[12]
	if blkbits < 9 || blkbits > 16 {
		return nil, errdefs.Invalid("EROFS block size 2^%d", blkbits)
	}
	blksz := int64(1) << blkbits
	rootNid := uint64(binary.LittleEndian.Uint16(sb[14:]))
	metaBlk := int64(binary.LittleEndian.Uint32(sb[40:]))
	xattrBlk := int64(binary.LittleEndian.Uint32(sb[44:]))

	w := &erofsWalk{r: r, size: size, blksz: blksz, meta: metaBlk * blksz, xattrs: xattrBlk * blksz, seen: map[uint64]bool{}}
	w.add(0, min(size, erofsSuperOffset+blksz)) // the boot area and superblock's block
	queue := []uint64{rootNid}
	for len(queue) > 0 {
		nid := queue[len(queue)-1]
		queue = queue[:len(queue)-1]
		children, err := w.inode(nid)
		if err != nil {
			return nil, err
		}
		queue = append(queue, children...)
	}
	return mergeRanges(w.ranges), nil
}

type erofsWalk struct {
	r      io.ReaderAt
	size   int64
	blksz  int64
	meta   int64
	xattrs int64 // where shared xattrs start (0: none)
	seen   map[uint64]bool
	ranges []Range
}

// erofsMaxXattr bounds what one shared xattr entry is taken to span: its
// header, a name and a value the size of a capability or an ACL.
const erofsMaxXattr = 512

// add records [off, off+n), clamped to the image (a damaged inode may
// claim a tail past its end).
func (w *erofsWalk) add(off, n int64) {
	n = min(n, w.size-off)
	if off >= 0 && n > 0 {
		w.ranges = append(w.ranges, Range{off, n})
	}
}

func (w *erofsWalk) read(off, n int64) ([]byte, error) {
	if off < 0 || n < 0 || off > w.size || n > w.size-off {
		return nil, errdefs.Invalid("EROFS metadata at %d+%d is outside the image (%d bytes)", off, n, w.size)
	}
	b := make([]byte, n)
	if _, err := w.r.ReadAt(b, off); err != nil && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("reading EROFS metadata at %d: %w", off, err)
	}
	return b, nil
}

// inode records inode nid's metadata and returns the nids of its
// directory's entries (none for other files).
func (w *erofsWalk) inode(nid uint64) ([]uint64, error) {
	if w.seen[nid] {
		return nil, nil // a hard link, or a crafted cycle
	}
	if len(w.seen) >= erofsMaxWalk {
		return nil, errdefs.Invalid("EROFS image has more than %d inodes", erofsMaxWalk)
	}
	w.seen[nid] = true
	pos := w.meta + int64(nid)*erofsSlotSize
	hdr, err := w.read(pos, 32)
	if err != nil {
		return nil, err
	}
	format := binary.LittleEndian.Uint16(hdr[0:])
	extended := format&1 == 1
	layout := (format >> 1) & 7
	icount := int64(binary.LittleEndian.Uint16(hdr[2:]))
	mode := binary.LittleEndian.Uint16(hdr[4:])
	isize, ilen := int64(0), int64(32)
	var rawBlk uint32
	if extended {
		ilen = 64
		full, err := w.read(pos, 64)
		if err != nil {
			return nil, err
		}
		isize = int64(binary.LittleEndian.Uint64(full[8:]))
		rawBlk = binary.LittleEndian.Uint32(full[16:])
	} else {
		isize = int64(binary.LittleEndian.Uint32(hdr[8:]))
		rawBlk = binary.LittleEndian.Uint32(hdr[16:])
	}
	if isize < 0 {
		return nil, errdefs.Invalid("EROFS inode %d: size %d", nid, isize)
	}
	xlen := int64(0)
	if icount > 0 {
		xlen = 12 + (icount-1)*4
	}
	tail := int64(0)
	switch layout {
	case erofsLayoutFlatInline:
		tail = isize % w.blksz
	case erofsLayoutChunkBased:
		// The chunk table follows: 4 or 8 bytes per chunk; its size is
		// told by i_u's chunk bits. Count a block of it at most per
		// 4 KiB of file, which covers the table for any chunk size.
		format := binary.LittleEndian.Uint16(hdr[16:])
		chunkSize := w.blksz << (format & 0x1f)
		if chunkSize > 0 {
			n := (isize + chunkSize - 1) / chunkSize
			tail = n * 8
		}
	case erofsLayoutFlatPlain:
	default:
		// Compressed: its extent map follows the inode; a block of it is
		// a fair bound for what lookups read.
		tail = min(w.blksz, isize)
	}
	w.add(pos, ilen+xlen+tail)
	if xlen > 0 && w.xattrs > 0 {
		// The ibody header: a name filter, then the count of shared
		// xattrs, whose ids (4-byte units from xattr_blkaddr) follow.
		xh, err := w.read(pos+ilen, xlen)
		if err != nil {
			return nil, err
		}
		shared := int64(xh[4])
		for k := range shared {
			if 12+4*k+4 > xlen {
				break
			}
			id := int64(binary.LittleEndian.Uint32(xh[12+4*k:]))
			w.add(w.xattrs+id*4, erofsMaxXattr)
		}
	}

	const sIFMT, sIFDIR, sIFLNK = 0o170000, 0o040000, 0o120000
	if mode&sIFMT == sIFLNK && isize > 0 && (layout == erofsLayoutFlatPlain || layout == erofsLayoutFlatInline) {
		// A target too long to sit inline is in blocks of its own.
		if whole := isize - tail; whole > 0 {
			w.add(int64(rawBlk)*w.blksz, whole)
		}
	}
	if mode&sIFMT != sIFDIR {
		return nil, nil
	}
	// A directory's blocks: whole ones at raw_blkaddr, its tail inline.
	var dir []byte
	switch layout {
	case erofsLayoutFlatPlain, erofsLayoutFlatInline:
	default:
		return nil, errdefs.Invalid("EROFS directory inode %d has data layout %d", nid, layout)
	}
	whole := isize
	if layout == erofsLayoutFlatInline {
		whole -= tail
	}
	if whole > 0 {
		off := int64(rawBlk) * w.blksz
		b, err := w.read(off, whole)
		if err != nil {
			return nil, err
		}
		w.add(off, whole)
		dir = append(dir, b...)
	}
	if tail > 0 {
		b, err := w.read(pos+ilen+xlen, tail)
		if err != nil {
			return nil, err
		}
		dir = append(dir, b...)
	}
	var children []uint64
	for blk := int64(0); blk < int64(len(dir)); blk += w.blksz {
		b := dir[blk:min(blk+w.blksz, int64(len(dir)))]
		if len(b) < erofsDirentSize {
			break
		}
		n := int(binary.LittleEndian.Uint16(b[8:])) / erofsDirentSize
		if n < 1 || n*erofsDirentSize > len(b) {
			return nil, errdefs.Invalid("EROFS directory inode %d: bad entry table", nid)
		}
		for i := range n {
			e := b[i*erofsDirentSize:]
			child := binary.LittleEndian.Uint64(e[0:])
			nameOff := int(binary.LittleEndian.Uint16(e[8:]))
			end := len(b)
			if i+1 < n {
				end = int(binary.LittleEndian.Uint16(b[(i+1)*erofsDirentSize+8:]))
			}
			if nameOff > len(b) || end > len(b) || nameOff > end {
				return nil, errdefs.Invalid("EROFS directory inode %d: bad entry names", nid)
			}
			name := b[nameOff:end]
			if k := indexByte(name, 0); k >= 0 {
				name = name[:k]
			}
			if string(name) == "." || string(name) == ".." {
				continue
			}
			children = append(children, child)
		}
	}
	return children, nil
}

func indexByte(b []byte, c byte) int {
	for i, x := range b {
		if x == c {
			return i
		}
	}
	return -1
}

// mergeRanges sorts rs and merges those that overlap or touch.
func mergeRanges(rs []Range) []Range {
	sort.Slice(rs, func(i, j int) bool { return rs[i].Off < rs[j].Off })
	var out []Range
	for _, r := range rs {
		if n := len(out); n > 0 && r.Off <= out[n-1].Off+out[n-1].Len {
			if end := r.Off + r.Len; end > out[n-1].Off+out[n-1].Len {
				out[n-1].Len = end - out[n-1].Off
			}
			continue
		}
		out = append(out, r)
	}
	return out
}

// ChunksOf returns the indexes of the chunks of ix that rs touch, in order.
func (ix *Index) ChunksOf(rs []Range) []int {
	var out []int
	last := -1
	cs := int64(ix.ChunkSize)
	for _, r := range rs {
		if r.Len <= 0 {
			continue
		}
		for c := int(r.Off / cs); int64(c)*cs < r.Off+r.Len && c < ix.Chunks(); c++ {
			if c > last {
				out = append(out, c)
				last = c
			}
		}
	}
	return out
}
