// Package remote keeps layer images in OCI registries and reads them on
// demand (DESIGN.md §4): a layer is pushed as an OCI artifact (its EROFS
// image, a chunk index, a small config) and added to the catalog by
// reference without copying it; an edge then serves the image as a file
// of a FUSE filesystem of its own, fetching fixed-size chunks with HTTP
// Range requests, verifying each against the index before use, and
// keeping them in a size-bounded node-local cache.
//
// Importers: apiserver (Push, Add), cmd/dsec (the layerfs daemon, the
// edge's Source), edge (through layer.Source only).
package remote

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// DefaultChunkSize is the bytes each index entry covers: DSec's size for
// block images. A smaller chunk reads less of an image that is touched
// sparsely; a larger one makes fewer requests for one read sequentially.
const DefaultChunkSize = 256 << 10

// Chunk size bounds: a page at least, and at most what one FUSE read
// and one cache file should hold.
const (
	minChunkSize = 4 << 10
	maxChunkSize = 16 << 20
)

// maxIndexBytes bounds an index read from a registry: 64 Ki chunks of
// 256 KiB cover 16 GiB per MiB of index, so 64 MiB covers any image the
// layer store accepts.
const maxIndexBytes = 64 << 20

// indexMagic starts an encoded Index.
var indexMagic = [8]byte{'D', 'S', 'E', 'C', 'C', 'H', 'K', '1'}

// Index holds the sha256 of every chunk of an image: chunk i covers bytes
// [i*ChunkSize, min((i+1)*ChunkSize, Size)).
type Index struct {
	ChunkSize int
	Size      int64
	Sums      [][sha256.Size]byte
}

// BuildIndex reads r (an image of size bytes) to its end and indexes it.
func BuildIndex(r io.Reader, size int64, chunkSize int) (*Index, error) {
	if chunkSize < minChunkSize || chunkSize > maxChunkSize || chunkSize%4096 != 0 {
		return nil, errdefs.Invalid("chunk size %d: want a multiple of 4 KiB between %d and %d", chunkSize, minChunkSize, maxChunkSize)
	}
	ix := &Index{ChunkSize: chunkSize, Size: size}
	buf := make([]byte, chunkSize)
	var read int64
	for {
		n, err := io.ReadFull(r, buf)
		if n > 0 {
			ix.Sums = append(ix.Sums, sha256.Sum256(buf[:n]))
			read += int64(n)
		}
		if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
			break
		}
		if err != nil {
			return nil, fmt.Errorf("indexing image: %w", err)
		}
	}
	if read != size {
		return nil, fmt.Errorf("indexing image: read %d bytes, expected %d", read, size)
	}
	return ix, nil
}

// Chunks is the number of chunks of the image.
func (ix *Index) Chunks() int { return len(ix.Sums) }

// ChunkLen is the length of chunk i (the last may be short).
func (ix *Index) ChunkLen(i int) int {
	off := int64(i) * int64(ix.ChunkSize)
	return int(min(int64(ix.ChunkSize), ix.Size-off))
}

// Check reports whether data is chunk i.
func (ix *Index) Check(i int, data []byte) error {
	if i < 0 || i >= len(ix.Sums) {
		return errdefs.Invalid("chunk %d out of range (%d chunks)", i, len(ix.Sums))
	}
	if len(data) != ix.ChunkLen(i) {
		return errdefs.Invalid("chunk %d: %d bytes, want %d", i, len(data), ix.ChunkLen(i))
	}
	if sha256.Sum256(data) != ix.Sums[i] {
		return errdefs.Invalid("chunk %d does not match its digest in the index", i)
	}
	return nil
}

// MarshalBinary encodes the index: the magic, the chunk size (u32), the
// image size (u64), the chunk count (u32), then the sums, big-endian.
func (ix *Index) MarshalBinary() ([]byte, error) {
	var b bytes.Buffer
	b.Grow(24 + len(ix.Sums)*sha256.Size)
	b.Write(indexMagic[:])
	var hdr [16]byte
	binary.BigEndian.PutUint32(hdr[0:], uint32(ix.ChunkSize))
	binary.BigEndian.PutUint64(hdr[4:], uint64(ix.Size))
	binary.BigEndian.PutUint32(hdr[12:], uint32(len(ix.Sums)))
	b.Write(hdr[:])
	for _, s := range ix.Sums {
		b.Write(s[:])
	}
	return b.Bytes(), nil
}

// UnmarshalIndex decodes and checks an encoded index: its chunk count
// must be the one its sizes imply.
func UnmarshalIndex(b []byte) (*Index, error) {
	if len(b) < 24 || !bytes.Equal(b[:8], indexMagic[:]) {
		return nil, errdefs.Invalid("not a dsec chunk index")
	}
	ix := &Index{
		ChunkSize: int(binary.BigEndian.Uint32(b[8:])),
		Size:      int64(binary.BigEndian.Uint64(b[12:])),
	}
	n := int(binary.BigEndian.Uint32(b[20:]))
	if ix.ChunkSize < minChunkSize || ix.ChunkSize > maxChunkSize || ix.ChunkSize%4096 != 0 {
		return nil, errdefs.Invalid("chunk index: bad chunk size %d", ix.ChunkSize)
	}
	if ix.Size < 0 || (ix.Size+int64(ix.ChunkSize)-1)/int64(ix.ChunkSize) != int64(n) {
		return nil, errdefs.Invalid("chunk index: %d chunks do not cover %d bytes in chunks of %d", n, ix.Size, ix.ChunkSize)
	}
	if len(b) != 24+n*sha256.Size {
		return nil, errdefs.Invalid("chunk index: %d bytes for %d chunks", len(b), n)
	}
	ix.Sums = make([][sha256.Size]byte, n)
	for i := range ix.Sums {
		copy(ix.Sums[i][:], b[24+i*sha256.Size:])
	}
	return ix, nil
}
