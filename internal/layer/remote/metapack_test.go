package remote

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// mkfsImage seals a tree of nested directories, small files (inline
// tails) and larger ones into an EROFS image with mkfs.erofs.
func mkfsImage(t *testing.T, dirs, files, fileBytes int) string {
	t.Helper()
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs mkfs.erofs in PATH: install erofs-utils")
	}
	tree := t.TempDir()
	rng := rand.New(rand.NewSource(1))
	for d := range dirs {
		dir := filepath.Join(tree, fmt.Sprintf("d%02d", d), fmt.Sprintf("sub%d", d%3))
		must(t, os.MkdirAll(dir, 0o755))
		for f := range files {
			b := make([]byte, fileBytes+rng.Intn(3000))
			rng.Read(b)
			must(t, os.WriteFile(filepath.Join(dir, fmt.Sprintf("file-with-a-long-name-%03d.py", f)), b, 0o644))
		}
		must(t, os.Symlink("../elsewhere", filepath.Join(dir, "link")))
	}
	img := filepath.Join(t.TempDir(), "image.erofs")
	if out, err := exec.Command("mkfs.erofs", "--quiet", img, tree).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.erofs: %v: %s", err, out)
	}
	return img
}

func TestMetaPackOfARealImage(t *testing.T) {
	img := mkfsImage(t, 12, 20, 40000)
	b, err := os.ReadFile(img)
	must(t, err)
	pack, err := BuildMetaPack(bytes.NewReader(b), int64(len(b)))
	must(t, err)
	if pack == nil {
		t.Fatal("no pack for an image whose metadata is small")
	}
	m, err := UnmarshalMetaPack(pack, int64(len(b)))
	must(t, err)
	if m.Bytes()*8 > int64(len(b)) || m.Bytes() < 4096 {
		t.Errorf("pack holds %d bytes of a %d-byte image", m.Bytes(), len(b))
	}
	// What it holds is the image's bytes; the superblock's page is there.
	for _, x := range m.ranges {
		p := make([]byte, x.Len)
		if !m.ReadAt(p, x.Off, int64(len(b))) || !bytes.Equal(p, b[x.Off:x.Off+x.Len]) {
			t.Fatalf("range %+v differs from the image", x)
		}
	}
	p := make([]byte, 4096)
	if !m.ReadAt(p, 0, int64(len(b))) {
		t.Error("the superblock's page is not in the pack")
	}
	// A read past what a range holds is not served from it.
	last := m.ranges[len(m.ranges)-1]
	if last.Off+last.Len < int64(len(b)) && m.ReadAt(make([]byte, last.Len+4096), last.Off, int64(len(b))) {
		t.Error("a read beyond the last range was served")
	}
	t.Logf("image %d KiB, metadata %d KiB in %d ranges", len(b)>>10, m.Bytes()>>10, len(m.ranges))
}

// Damaged images end the walk with an error (or a pack that still only
// holds image bytes), never a panic or an endless walk.
func TestMetadataRangesOfDamagedImages(t *testing.T) {
	img := mkfsImage(t, 4, 6, 2000)
	orig, err := os.ReadFile(img)
	must(t, err)
	rng := rand.New(rand.NewSource(7))
	for i := range 400 {
		b := append([]byte(nil), orig...)
		for range 1 + rng.Intn(8) {
			b[rng.Intn(min(len(b), 64<<10))] = byte(rng.Intn(256))
		}
		if i%50 == 0 {
			b = b[:rng.Intn(len(b))]
		}
		rs, err := MetadataRanges(bytes.NewReader(b), int64(len(b)))
		if err != nil {
			continue
		}
		for _, x := range rs {
			if x.Off < 0 || x.Len <= 0 || x.Off+x.Len > int64(len(b))+4096 {
				t.Fatalf("range %+v outside a %d-byte image", x, len(b))
			}
		}
	}
	if _, err := MetadataRanges(bytes.NewReader(make([]byte, 8192)), 8192); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("zeroes: %v", err)
	}
	if _, err := MetadataRanges(bytes.NewReader(nil), 0); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("empty: %v", err)
	}
}

func TestMetaPackRefusesBadEncodings(t *testing.T) {
	enc := func(data int, rs ...Range) []byte {
		var b bytes.Buffer
		b.Write(metaMagic[:])
		binary.Write(&b, binary.LittleEndian, uint32(len(rs)))
		for _, x := range rs {
			binary.Write(&b, binary.LittleEndian, uint64(x.Off))
			binary.Write(&b, binary.LittleEndian, uint32(x.Len))
		}
		b.Write(make([]byte, data))
		return b.Bytes()
	}
	good := enc(8192, Range{0, 4096}, Range{8192, 4096})
	m, err := UnmarshalMetaPack(good, 1<<20)
	must(t, err)
	if !m.ReadAt(make([]byte, 100), 8200, 1<<20) || m.ReadAt(make([]byte, 100), 4090, 1<<20) || m.ReadAt(make([]byte, 4096), 4096, 1<<20) {
		t.Error("ReadAt serves what it does not hold, or not what it does")
	}
	for name, b := range map[string][]byte{
		"magic":         append([]byte("XXXXXXXX"), good[8:]...),
		"short":         good[:10],
		"overlap":       enc(8192, Range{0, 4096}, Range{100, 4096}),
		"out of order":  enc(8192, Range{8192, 4096}, Range{0, 4096}),
		"past the end":  enc(4096, Range{1 << 20, 4096}),
		"too few bytes": enc(4095, Range{0, 4096}),
		"extra bytes":   enc(4097, Range{0, 4096}),
		"empty range":   enc(0, Range{0, 0}),
		"huge count":    append(append([]byte(nil), metaMagic[:]...), 0xff, 0xff, 0xff, 0xff),
	} {
		if _, err := UnmarshalMetaPack(b, 1<<20); !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s: %v", name, err)
		}
	}
}
