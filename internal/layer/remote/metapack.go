package remote

import (
	"bytes"
	"context"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
)

// A metadata pack holds the bytes of an image's metadata (MetadataRanges,
// widened to whole pages): the superblock, inodes, inline tails and
// directory blocks. mkfs.erofs interleaves them with file data, so they
// touch most chunks of an image (58% of the 256 KiB chunks of a 247 MiB
// debootstrap base, for 6% of its bytes): fetched chunk by chunk, a walk
// of the tree would pull in most of the image. The pack is one blob of
// the artifact, fetched whole when an edge first registers the layer
// (checked against its digest, kept with the node's indexes), and the
// kernel's metadata reads, single pages through the page cache of the
// image file, are then served from it without touching the source. When
// a data read fetches the chunks around metadata, the bytes the pack
// holds are taken from it and only the rest is asked of the source
// (Reader.fetchRun); the chunk so completed is verified like any other.
//
// Encoded: metaMagic, a uint32 count, count × (uint64 offset, uint32
// length) sorted and disjoint, then the ranges' bytes in order.

var metaMagic = [8]byte{'D', 'S', 'E', 'C', 'M', 'E', 'T', '1'}

const (
	// metaPage is the granularity of the pack: the page size, the unit
	// of the reads it must cover whole.
	metaPage = 4096
	// maxMetaFraction bounds a pack against its image: metadata past a
	// quarter of an image is no longer worth fetching eagerly.
	maxMetaFraction = 4
	metaEntry       = 12
)

// metaBound is the largest pack an image of size bytes may have: a
// quarter of it, and the header of as many page ranges as that holds.
// A node maps the pack from disk rather than holding it on its heap.
func metaBound(size int64) int64 {
	data := size / maxMetaFraction
	return int64(len(metaMagic)) + 4 + (data/metaPage+1)*metaEntry + data
}

// MetaPack is a decoded metadata pack.
type MetaPack struct {
	ranges []Range
	starts []int64 // offset of each range's bytes in data
	data   []byte
	unmap  func() // for a mapped pack (openMetaPack)
}

// Close releases a mapped pack; it must not be read after.
func (m *MetaPack) Close() {
	if m.unmap != nil {
		m.unmap()
		m.unmap = nil
	}
}

// BuildMetaPack returns the encoded metadata pack of the EROFS image r of
// size bytes, or nil when its metadata is more than a quarter of it.
func BuildMetaPack(r io.ReaderAt, size int64) ([]byte, error) {
	rs, err := MetadataRanges(r, size)
	if err != nil {
		return nil, err
	}
	for i := range rs {
		lo := rs[i].Off &^ (metaPage - 1)
		hi := min((rs[i].Off+rs[i].Len+metaPage-1)&^(metaPage-1), size)
		rs[i] = Range{lo, hi - lo}
	}
	rs = mergeRanges(rs)
	var total int64
	for _, x := range rs {
		total += x.Len
	}
	if total*maxMetaFraction > size {
		return nil, nil
	}
	return encodeMetaPack(r, rs)
}

// encodeMetaPack encodes the ranges rs (sorted, disjoint) of r.
func encodeMetaPack(r io.ReaderAt, rs []Range) ([]byte, error) {
	var b bytes.Buffer
	b.Write(metaMagic[:])
	binary.Write(&b, binary.LittleEndian, uint32(len(rs)))
	for _, x := range rs {
		binary.Write(&b, binary.LittleEndian, uint64(x.Off))
		binary.Write(&b, binary.LittleEndian, uint32(x.Len))
	}
	for _, x := range rs {
		buf := make([]byte, x.Len)
		if _, err := r.ReadAt(buf, x.Off); err != nil && err != io.EOF {
			return nil, err
		}
		b.Write(buf)
	}
	return b.Bytes(), nil
}

// UnmarshalMetaPack decodes a pack of an image of size bytes, checking
// that its ranges are sorted, disjoint, inside the image and that its
// bytes are all there.
func UnmarshalMetaPack(b []byte, size int64) (*MetaPack, error) {
	if len(b) < len(metaMagic)+4 || !bytes.Equal(b[:len(metaMagic)], metaMagic[:]) {
		return nil, errdefs.Invalid("metadata pack: bad header")
	}
	n := int64(binary.LittleEndian.Uint32(b[len(metaMagic):]))
	head := int64(len(metaMagic) + 4)
	if n*metaEntry > int64(len(b))-head {
		return nil, errdefs.Invalid("metadata pack: %d ranges do not fit", n)
	}
	m := &MetaPack{ranges: make([]Range, n), starts: make([]int64, n)}
	var at, end int64
	for i := range n {
		e := b[head+i*metaEntry:]
		off := binary.LittleEndian.Uint64(e)
		x := Range{int64(off & (1<<62 - 1)), int64(binary.LittleEndian.Uint32(e[8:]))}
		// Whole pages (the last may end with the image): at most one
		// range per page, however the pack was made.
		if off >= 1<<62 || x.Off < end || x.Len <= 0 || x.Off > size || x.Len > size-x.Off ||
			x.Off%metaPage != 0 || x.Len%metaPage != 0 && x.Off+x.Len != size {
			return nil, errdefs.Invalid("metadata pack: range %d (%d+%d) is out of order, not whole pages or outside the image", i, x.Off, x.Len)
		}
		m.ranges[i], m.starts[i] = x, at
		at += x.Len
		end = x.Off + x.Len
	}
	m.data = b[head+n*metaEntry:]
	if int64(len(m.data)) != at {
		return nil, errdefs.Invalid("metadata pack: %d bytes for ranges of %d", len(m.data), at)
	}
	return m, nil
}

// Bytes is the metadata the pack holds.
func (m *MetaPack) Bytes() int64 { return int64(len(m.data)) }

// ReadAt fills p from off if the pack holds all of [off, off+len(p)),
// and reports whether it did. end clamps the read to the image's end.
func (m *MetaPack) ReadAt(p []byte, off, end int64) bool {
	hi := min(off+int64(len(p)), end)
	if off < 0 || hi <= off {
		return false
	}
	i := sort.Search(len(m.ranges), func(i int) bool { return m.ranges[i].Off+m.ranges[i].Len > off })
	if i == len(m.ranges) || m.ranges[i].Off > off || m.ranges[i].Off+m.ranges[i].Len < hi {
		return false
	}
	s := m.starts[i] + off - m.ranges[i].Off
	copy(p, m.data[s:s+hi-off])
	return true
}

// held calls fn for each stretch [lo, hi) of [off, end) the pack holds,
// in order, with where its bytes start in m.data. A nil pack holds none.
func (m *MetaPack) held(off, end int64, fn func(lo, hi, at int64)) {
	if m == nil {
		return
	}
	i := sort.Search(len(m.ranges), func(i int) bool { return m.ranges[i].Off+m.ranges[i].Len > off })
	for ; i < len(m.ranges) && m.ranges[i].Off < end; i++ {
		x := m.ranges[i]
		lo, hi := max(x.Off, off), min(x.Off+x.Len, end)
		fn(lo, hi, m.starts[i]+lo-x.Off)
	}
}

// Fill copies into p the bytes of [off, off+len(p)) that the pack holds
// and returns, in order, the stretches it does not hold.
func (m *MetaPack) Fill(p []byte, off int64) []Range {
	end := off + int64(len(p))
	var gaps []Range
	next := off
	m.held(off, end, func(lo, hi, at int64) {
		if lo > next {
			gaps = append(gaps, Range{next, lo - next})
		}
		copy(p[lo-off:hi-off], m.data[at:at+hi-lo])
		next = hi
	})
	if next < end {
		gaps = append(gaps, Range{next, end - next})
	}
	return gaps
}

// Held is how many bytes of [off, end) the pack holds.
func (m *MetaPack) Held(off, end int64) int64 {
	var n int64
	m.held(off, end, func(lo, hi, _ int64) { n += hi - lo })
	return n
}

// fetchMetaPack streams the pack d of an image of size bytes from repo
// into the file path, checking its size and digest on the way (the pack
// may be large: it is not held in memory).
func fetchMetaPack(ctx context.Context, repo *image.Repo, d string, n, size int64, path string) error {
	if n <= 0 || n > metaBound(size) {
		return errdefs.Invalid("metadata pack of %d bytes for an image of %d", n, size)
	}
	tmp := path + ".part"
	f, err := os.OpenFile(tmp, os.O_CREATE|os.O_TRUNC|os.O_WRONLY, 0o600)
	if err != nil {
		return err
	}
	defer os.Remove(tmp)
	got, sum, err := copyBlob(ctx, repo, d, n, f)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	switch {
	case err != nil:
		return err
	case got != n:
		return errdefs.Invalid("metadata pack %s: %d bytes, the manifest says %d", short(d), got, n)
	case sum != d:
		return errdefs.Invalid("metadata pack %s does not match its digest", short(d))
	}
	return os.Rename(tmp, path)
}

// openMetaPack maps the pack kept at path (of digest d) and decodes it.
// The mapping lives as long as the returned pack.
func openMetaPack(path, d string, size int64) (*MetaPack, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	fi, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if fi.Size() <= 0 || fi.Size() > metaBound(size) {
		return nil, errdefs.Invalid("metadata pack of %d bytes for an image of %d", fi.Size(), size)
	}
	b, err := unix.Mmap(int(f.Fd()), 0, int(fi.Size()), unix.PROT_READ, unix.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("mapping metadata pack: %w", err)
	}
	sum := sha256.Sum256(b)
	m, err := UnmarshalMetaPack(b, size)
	if err == nil && "sha256:"+hex.EncodeToString(sum[:]) != d {
		err = errdefs.Invalid("kept metadata pack %s does not match its digest", short(d))
	}
	if err != nil {
		unix.Munmap(b)
		return nil, err
	}
	m.unmap = func() { unix.Munmap(b) }
	return m, nil
}
