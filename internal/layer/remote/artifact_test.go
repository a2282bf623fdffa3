package remote

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/binary"
	"encoding/json"
	"errors"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/image"
	"github.com/dsecproject/dsec/internal/image/registrytest"
	"github.com/dsecproject/dsec/internal/layer"
	"github.com/dsecproject/dsec/internal/store"
)

// newLayerStore returns a layer store in a temp dir with one base layer
// built from a tree of a few files, one of them big enough to span many
// chunks.
func newLayerStore(t *testing.T) (*layer.Store, api.Layer, string) {
	t.Helper()
	if _, err := exec.LookPath("mkfs.erofs"); err != nil {
		t.Skip("needs mkfs.erofs in PATH: install erofs-utils")
	}
	st, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { st.Close() })
	tree := t.TempDir()
	big := make([]byte, 3<<20+12345)
	rand.Read(big)
	must(t, os.MkdirAll(filepath.Join(tree, "usr/lib"), 0o755))
	must(t, os.WriteFile(filepath.Join(tree, "usr/lib/big.bin"), big, 0o644))
	must(t, os.WriteFile(filepath.Join(tree, "hello.txt"), []byte("hello from the registry\n"), 0o644))
	ref, _ := layer.ParseRef("base/remote-test:1")
	l, err := st.BuildFromDir(context.Background(), ref, tree, layer.BuildOptions{}, nil)
	if err != nil {
		if os.Geteuid() != 0 {
			t.Skipf("building a layer as non-root: %v", err)
		}
		t.Fatal(err)
	}
	return st, l, tree
}

func must(t *testing.T, err error) {
	t.Helper()
	if err != nil {
		t.Fatal(err)
	}
}

func TestPushAddRoundTrip(t *testing.T) {
	reg := registrytest.Start(t)
	st, l, _ := newLayerStore(t)
	ctx := context.Background()
	target := Scheme + reg.Addr + "/dsec/layers:remote-test"

	res, err := Push(ctx, st, l.Ref, target, PushOptions{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	if res.Uploaded != 4 || res.SizeBytes != l.SizeBytes { // image, index, metadata pack, config
		t.Fatalf("push: %+v", res)
	}
	// A second push sends nothing the registry has.
	if res2, err := Push(ctx, st, l.Ref, target, PushOptions{Insecure: true}); err != nil || res2.Uploaded != 0 || res2.Manifest != res.Manifest {
		t.Fatalf("second push: %+v %v", res2, err)
	}
	if _, err := os.Stat(reg.BlobPath(l.Digest)); err != nil {
		t.Fatalf("the image is not in the registry under its own digest: %v", err)
	}

	// Another catalog adds it by reference, without copying the image.
	other, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	defer other.Close()
	got, err := Add(ctx, other, "base/from-registry:1", target, AddOptions{Insecure: true})
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != l.Digest || got.SizeBytes != l.SizeBytes || got.Remote == nil || got.Remote.Pull != api.PullLazy ||
		got.Remote.ChunkSize != DefaultChunkSize || got.Remote.Manifest != res.Manifest || got.Remote.Meta == "" || got.Remote.MetaSize <= 0 {
		t.Fatalf("added: %+v %+v", got, got.Remote)
	}
	if p := other.BlobPath(l.Digest); fileExists(p) {
		t.Fatal("add copied the image into the layer directory")
	}
	back, err := other.Get(l.Digest)
	if err != nil || back.Remote == nil || back.Remote.Source != target {
		t.Fatalf("catalog by digest: %+v %v", back, err)
	}

	// Bad input changes nothing.
	for _, c := range []struct {
		ref, src string
		opts     AddOptions
		want     error
	}{
		{"base/x:1", "http://" + reg.Addr + "/dsec/layers:remote-test", AddOptions{Insecure: true}, errdefs.ErrInvalid},
		{"base/x:1", Scheme + "dsec/layers:remote-test", AddOptions{Insecure: true}, errdefs.ErrInvalid},
		{"base/x:1", Scheme + reg.Addr + "/dsec/layers:missing", AddOptions{Insecure: true}, errdefs.ErrNotFound},
		{"workspace/x:1", target, AddOptions{Insecure: true}, errdefs.ErrInvalid},
		{"base/x:1", target, AddOptions{Insecure: true, Pull: "sometimes"}, errdefs.ErrInvalid},
		{"base/from-registry:1", target, AddOptions{Insecure: true}, errdefs.ErrAlreadyExists},
	} {
		if _, err := Add(ctx, other, c.ref, c.src, c.opts); !errors.Is(err, c.want) {
			t.Errorf("Add(%s, %s): %v, want %v", c.ref, c.src, err, c.want)
		}
	}
	all, _ := other.List("")
	if len(all) != 1 {
		t.Fatalf("refused adds left entries: %+v", all)
	}
	// A remote layer has no image here to push.
	if _, err := Push(ctx, other, "base/from-registry:1", target+"2", PushOptions{Insecure: true}); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Fatalf("push of a remote layer: %v", err)
	}
}

// Reindex gives the same image another chunk size under a new tag; the
// image blob is not sent again.
func TestReindex(t *testing.T) {
	reg := registrytest.Start(t)
	st, l, _ := newLayerStore(t)
	ctx := context.Background()
	src := Scheme + reg.Addr + "/dsec/layers:ri"
	if _, err := Push(ctx, st, l.Ref, src, PushOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	dst := Scheme + reg.Addr + "/dsec/layers:ri-64k"
	if _, err := Reindex(ctx, src, dst, 64<<10, image.RepoOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	cat, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	defer cat.Close()
	got, err := Add(ctx, cat, "base/ri64:1", dst, AddOptions{Insecure: true})
	if err != nil || got.Digest != l.Digest || got.Remote.ChunkSize != 64<<10 {
		t.Fatalf("reindexed: %+v %v", got, err)
	}
	// One digest, one index in a catalog: the 256 KiB artifact of the
	// same image is refused there.
	if _, err := Add(ctx, cat, "base/ri256:1", src, AddOptions{Insecure: true}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a second index for one digest: %v", err)
	}
	if _, err := Add(ctx, cat, "base/ri64-again:1", dst, AddOptions{Insecure: true}); err != nil {
		t.Fatalf("the same artifact under a second ref: %v", err)
	}
	if _, err := Reindex(ctx, src, Scheme+"127.0.0.1:1/other:x", 64<<10, image.RepoOptions{Insecure: true}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("reindex into another repository: %v", err)
	}
}

// An image in the registry that does not match the chunk index is
// refused when it is added.
func TestAddRefusesAnImageThatDoesNotMatchItsIndex(t *testing.T) {
	reg := registrytest.Start(t)
	st, l, _ := newLayerStore(t)
	ctx := context.Background()
	target := Scheme + reg.Addr + "/dsec/layers:bad"
	if _, err := Push(ctx, st, l.Ref, target, PushOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	corrupt(t, reg.BlobPath(l.Digest), 100)
	_, err := Add(ctx, st, "base/bad:1", target, AddOptions{Insecure: true})
	if err == nil || !strings.Contains(err.Error(), "does not match") {
		t.Fatalf("add of a corrupted image: %v", err)
	}
}

// corrupt flips a byte of the file at off, keeping its size.
func corrupt(t *testing.T, path string, off int64) {
	t.Helper()
	f, err := os.OpenFile(path, os.O_RDWR, 0)
	must(t, err)
	defer f.Close()
	b := make([]byte, 1)
	_, err = f.ReadAt(b, off)
	must(t, err)
	b[0] ^= 0xff
	_, err = f.WriteAt(b, off)
	must(t, err)
}

func fileExists(p string) bool {
	_, err := os.Stat(p)
	return err == nil
}

func TestIndexRoundTrip(t *testing.T) {
	data := make([]byte, 3*4096+17)
	rand.Read(data)
	ix, err := BuildIndex(strings.NewReader(string(data)), int64(len(data)), 4096)
	must(t, err)
	if ix.Chunks() != 4 || ix.ChunkLen(3) != 17 {
		t.Fatalf("index: %d chunks, last %d", ix.Chunks(), ix.ChunkLen(3))
	}
	b, _ := ix.MarshalBinary()
	back, err := UnmarshalIndex(b)
	must(t, err)
	for i := range back.Chunks() {
		if err := back.Check(i, data[i*4096:min(len(data), (i+1)*4096)]); err != nil {
			t.Fatal(err)
		}
	}
	bad := append([]byte(nil), data[:4096]...)
	bad[7] ^= 1
	if err := back.Check(0, bad); err == nil {
		t.Fatal("a changed chunk passed")
	}
	if err := back.Check(3, data[3*4096:]); err != nil {
		t.Fatal(err)
	}
	if err := back.Check(3, data[3*4096:len(data)-1]); err == nil {
		t.Fatal("a short chunk passed")
	}
	// Truncated, padded and inconsistent encodings are refused.
	for _, b2 := range [][]byte{b[:len(b)-1], append(append([]byte(nil), b...), 0), b[:10]} {
		if _, err := UnmarshalIndex(b2); err == nil {
			t.Fatalf("bad index of %d bytes accepted", len(b2))
		}
	}
	lie := append([]byte(nil), b...)
	lie[19]++ // size one byte more than the chunks cover... still 4 chunks
	lie[23]++ // and one chunk more than the size needs
	if _, err := UnmarshalIndex(lie); err == nil {
		t.Fatal("index with a wrong count accepted")
	}
}

// A metadata pack whose bytes differ from the image where the first
// chunk (verified against the index) shows them is refused at add, and
// one that does not match its digest is too.
func TestAddRefusesAMetadataPackThatDoesNotMatchTheImage(t *testing.T) {
	reg := registrytest.Start(t)
	st, l, _ := newLayerStore(t)
	ctx := context.Background()
	target := Scheme + reg.Addr + "/dsec/layers:meta"
	if _, err := Push(ctx, st, l.Ref, target, PushOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	sref, _ := ParseSource(target)
	repo, err := image.OpenRepo(sref, image.RepoOptions{Insecure: true})
	must(t, err)
	body, _, _, err := repo.Manifest(ctx, "meta")
	must(t, err)
	var m manifest
	must(t, json.Unmarshal(body, &m))
	k := slices.IndexFunc(m.Layers, func(d descriptor) bool { return d.MediaType == MetaType })
	if k < 0 {
		t.Fatalf("pushed manifest has no metadata pack: %s", body)
	}
	pack, err := repo.Blob(ctx, m.Layers[k].Digest, m.Layers[k].Size, 1<<30)
	must(t, err)
	pm, err := UnmarshalMetaPack(pack, l.SizeBytes)
	must(t, err)
	// The superblock's magic, as the pack holds it.
	bad := append([]byte(nil), pack...)
	bad[len(pack)-len(pm.data)+erofsSuperOffset] ^= 0xff
	bd := descriptor{MediaType: MetaType, Digest: digestOf(bad), Size: int64(len(bad))}
	_, err = repo.PushBlob(ctx, bd.Digest, bd.Size, func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(bad)), nil })
	must(t, err)
	good := m.Layers[k]
	m.Layers[k] = bd
	mb, _ := json.Marshal(m)
	_, err = repo.PushManifest(ctx, "meta-bad", manifestType, mb)
	must(t, err)
	other, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	defer other.Close()
	if _, err := Add(ctx, other, "base/meta-bad:1", Scheme+reg.Addr+"/dsec/layers:meta-bad", AddOptions{Insecure: true}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("add with a pack that does not match the image: %v", err)
	}
	// Another pack that passes every check (one page of the good one):
	// the catalog already serves the digest with the first, so it is
	// refused; a catalog without the digest takes it.
	one := &bytes.Buffer{}
	one.Write(metaMagic[:])
	binary.Write(one, binary.LittleEndian, uint32(1))
	binary.Write(one, binary.LittleEndian, uint64(pm.ranges[0].Off))
	binary.Write(one, binary.LittleEndian, uint32(metaPage))
	one.Write(pm.data[:metaPage])
	od := descriptor{MediaType: MetaType, Digest: digestOf(one.Bytes()), Size: int64(one.Len())}
	_, err = repo.PushBlob(ctx, od.Digest, od.Size, func() (io.ReadCloser, error) { return io.NopCloser(bytes.NewReader(one.Bytes())), nil })
	must(t, err)
	m.Layers[k] = od
	mb, _ = json.Marshal(m)
	_, err = repo.PushManifest(ctx, "meta-other", manifestType, mb)
	must(t, err)
	if _, err := Add(ctx, other, "base/meta-good:1", target, AddOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	if _, err := Add(ctx, other, "base/meta-other:1", Scheme+reg.Addr+"/dsec/layers:meta-other", AddOptions{Insecure: true}); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("a second metadata pack for one digest: %v", err)
	}
	fresh, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	defer fresh.Close()
	if _, err := Add(ctx, fresh, "base/meta-other:1", Scheme+reg.Addr+"/dsec/layers:meta-other", AddOptions{Insecure: true}); err != nil {
		t.Fatalf("the other pack in a catalog of its own: %v", err)
	}
	must(t, other.Delete("base/meta-good:1", nil))
	// The registry's copy of the good pack damaged: its digest fails.
	corrupt(t, reg.BlobPath(good.Digest), int64(len(pack)-1))
	if _, err := Add(ctx, other, "base/meta-bad:2", target, AddOptions{Insecure: true}); err == nil {
		t.Fatal("add with a pack that does not match its digest")
	}
	if all, _ := other.List(""); len(all) != 0 {
		t.Fatalf("refused adds left entries: %+v", all)
	}
}

// WithoutMeta tags the same artifact without its metadata pack: added
// from there, a layer names none (and reads as artifacts from before).
func TestWithoutMeta(t *testing.T) {
	reg := registrytest.Start(t)
	st, l, _ := newLayerStore(t)
	ctx := context.Background()
	src := Scheme + reg.Addr + "/dsec/layers:wm"
	if _, err := Push(ctx, st, l.Ref, src, PushOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	dst := src + "-nometa"
	if _, err := WithoutMeta(ctx, src, dst, image.RepoOptions{Insecure: true}); err != nil {
		t.Fatal(err)
	}
	cat, err := layer.NewStore(t.TempDir(), store.NewMemory(), nil)
	must(t, err)
	defer cat.Close()
	got, err := Add(ctx, cat, "base/wm:1", dst, AddOptions{Insecure: true})
	if err != nil || got.Remote.Meta != "" || got.Digest != l.Digest {
		t.Fatalf("added without the pack: %+v %v", got.Remote, err)
	}
	if _, err := WithoutMeta(ctx, src, Scheme+"127.0.0.1:1/other:x", image.RepoOptions{Insecure: true}); !errors.Is(err, errdefs.ErrInvalid) {
		t.Fatalf("into another repository: %v", err)
	}
}
