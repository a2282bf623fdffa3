package layer

import (
	"context"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/store"
	"golang.org/x/sys/unix"
)

// stagePair is a stager (an edge) and an adopter (an apiserver) on one
// layer directory and catalog, as in a cluster.
func stagePair(t *testing.T) (stager, adopter *Store, dir string) {
	t.Helper()
	dir = filepath.Join(t.TempDir(), "layers")
	st := store.NewMemory()
	var err error
	if stager, err = NewNodeStore(dir, st, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stager.Close() })
	if adopter, err = NewStore(dir, st, nil); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { adopter.Close() })
	return stager, adopter, dir
}

// stageBytes puts data in s's staging directory as an image it staged,
// and returns its Staged and the snapshot layer it claims to be.
func stageBytes(t *testing.T, s *Store, name string, data []byte) (Staged, api.Layer) {
	t.Helper()
	if err := os.WriteFile(filepath.Join(s.StagingDir(), name), data, 0o600); err != nil {
		t.Fatal(err)
	}
	sum := sha256.Sum256(data)
	d := "sha256:" + hex.EncodeToString(sum[:])
	return Staged{Instance: s.instance, Name: name, Digest: d, Size: int64(len(data))},
		api.Layer{Ref: "snapshot/staged:1", Kind: api.KindSnapshot, Digest: d, SizeBytes: int64(len(data)), Snapshot: &api.SnapshotInfo{Sandbox: "sb-1"}}
}

// TestStageAndAdopt: what an edge stages, an apiserver publishes; the
// staged image goes, the blob holds the same bytes, and a ref is never
// re-pointed by an adoption.
func TestStageAndAdopt(t *testing.T) {
	needRootAndMkfs(t)
	edge, api_, dir := stagePair(t)
	src := filepath.Join(t.TempDir(), "src")
	writeTree(t, src, baseTree)
	ctx := context.Background()
	info := &api.SnapshotInfo{Sandbox: "sb-1", CreatedBy: "k1"}
	l, st, err := edge.Stage(ctx, mustRef(t, "snapshot/s:1"), src, BuildOptions{Snapshot: info, Project: "p1"}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := edge.Resolve("snapshot/s:1"); !errors.Is(err, errdefs.ErrNotFound) {
		t.Fatalf("a staged layer is in the catalog before its adoption: %v", err)
	}
	if left, _ := edge.Staged(); len(left) != 1 || left[0] != st.Name {
		t.Fatalf("staged: %v, want [%s]", left, st.Name)
	}
	got, err := api_.Adopt(ctx, st, l)
	if err != nil {
		t.Fatal(err)
	}
	if got.Digest != l.Digest || got.Ref != "snapshot/s:1" || got.Project != "p1" || got.Snapshot == nil || got.Snapshot.Sandbox != "sb-1" {
		t.Fatalf("adopted: %+v", got)
	}
	if r, err := edge.Resolve("snapshot/s:1"); err != nil || r.Digest != l.Digest {
		t.Fatalf("the edge's store resolving the adopted layer: %+v %v", r, err)
	}
	if d, _, err := hashFile(api_.BlobPath(l.Digest)); err != nil || d != l.Digest {
		t.Fatalf("the blob: %s %v, want %s", d, err, l.Digest)
	}
	assertStagingClean(t, dir)
	assertOutboxClean(t, dir)

	// What a node's store refuses, and what a publishing store does.
	if _, err := edge.BuildFromDir(ctx, mustRef(t, "base/x:1"), src, BuildOptions{}, nil); !errors.Is(err, ErrNodeStore) {
		t.Errorf("a node's store building: %v", err)
	}
	if err := edge.Delete("snapshot/s:1", nil); !errors.Is(err, ErrNodeStore) {
		t.Errorf("a node's store deleting: %v", err)
	}
	if _, err := edge.Adopt(ctx, st, l); !errors.Is(err, ErrNodeStore) {
		t.Errorf("a node's store adopting: %v", err)
	}
	if _, _, err := api_.Stage(ctx, mustRef(t, "snapshot/u:1"), src, BuildOptions{Snapshot: info}, nil); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("a publishing store staging: %v", err)
	}

	// An image staged long ago and never adopted goes at the next
	// Stage; one staged a moment ago stays.
	old := filepath.Join(edge.StagingDir(), "image-42.erofs")
	recent := filepath.Join(edge.StagingDir(), "image-43.erofs")
	for _, p := range []string{old, recent} {
		if err := os.WriteFile(p, []byte("left"), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Chtimes(old, time.Now().Add(-stagedKeep-time.Minute), time.Now().Add(-stagedKeep-time.Minute)); err != nil {
		t.Fatal(err)
	}
	_, st3, err := edge.Stage(ctx, mustRef(t, "snapshot/v:1"), src, BuildOptions{Snapshot: info}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(old); !errors.Is(err, os.ErrNotExist) {
		t.Errorf("an unadopted image older than %v is kept: %v", stagedKeep, err)
	}
	if _, err := os.Stat(recent); err != nil {
		t.Errorf("a recent staged image is gone: %v", err)
	}
	os.Remove(recent)
	os.Remove(filepath.Join(edge.StagingDir(), st3.Name))

	// Staged again under the same ref: refused, and the image goes.
	l2, st2, err := edge.Stage(ctx, mustRef(t, "snapshot/t:1"), src, BuildOptions{Snapshot: info}, nil)
	if err != nil {
		t.Fatal(err)
	}
	l2.Ref = "snapshot/s:1"
	if _, err := api_.Adopt(ctx, st2, l2); !errors.Is(err, errdefs.ErrAlreadyExists) {
		t.Fatalf("adopting over an existing ref: %v", err)
	}
	assertStagingClean(t, dir)
	assertOutboxClean(t, dir)
}

// assertOutboxClean fails if a node's staged image is left.
func assertOutboxClean(t *testing.T, dir string) {
	t.Helper()
	if left, _ := filepath.Glob(filepath.Join(dir, outboxRoot, "*", "image-*")); len(left) > 0 {
		t.Errorf("staged images left: %v", left)
	}
}

// TestAdoptRefusesWhatAStagerForges: a stager (a subverted node) names
// files outside its staging directory, links, a FIFO, a device, bytes
// that are not the digest it claims (another layer's digest above all),
// or rewrites the image after handing it over. Nothing of it is
// published, and what was under the name is removed once looked at.
func TestAdoptRefusesWhatAStagerForges(t *testing.T) {
	edge, apisrv, dir := stagePair(t)
	ctx := context.Background()
	secret := filepath.Join(t.TempDir(), "secret")
	if err := os.WriteFile(secret, []byte("the apiserver host's secret"), 0o600); err != nil {
		t.Fatal(err)
	}
	genuine := []byte(strings.Repeat("genuine image ", 1000))
	gst, gl := stageBytes(t, edge, "image-100.erofs", genuine)
	gl.Ref = "base/genuine:1"
	gl.Kind, gl.Snapshot = api.KindBase, nil
	if _, err := apisrv.Adopt(ctx, gst, gl); err != nil {
		t.Fatalf("a genuine staged image: %v", err)
	}

	n := 0
	refused := func(name string, st Staged, l api.Layer, want string) {
		t.Helper()
		n++
		l.Ref = "snapshot/forged:" + strconv.Itoa(n)
		done := make(chan error, 1)
		go func() { _, err := apisrv.Adopt(ctx, st, l); done <- err }()
		var err error
		select {
		case err = <-done:
		case <-time.After(10 * time.Second):
			t.Fatalf("%s: the adoption hangs", name)
		}
		if err == nil || !strings.Contains(err.Error(), want) {
			t.Errorf("%s: %v, want an error with %q", name, err, want)
		}
		if errdefs.Code(err) != "internal" {
			t.Errorf("%s: an error of class %s, want none (the node's fault, not the caller's)", name, errdefs.Code(err))
		}
		if _, err := apisrv.Resolve(l.Ref); err == nil {
			t.Errorf("%s: %s is in the catalog", name, l.Ref)
		}
	}

	// Names that leave the staging directory: refused before any lookup.
	st, l := stageBytes(t, edge, "image-1.erofs", []byte("x"))
	for _, bad := range []Staged{
		{Instance: st.Instance, Name: "../../blobs/sha256/x.erofs"},
		{Instance: st.Instance, Name: "/etc/passwd"},
		{Instance: "../staging", Name: st.Name},
		{Instance: st.Instance + "/..", Name: st.Name},
		{Instance: "", Name: st.Name},
	} {
		bad.Digest, bad.Size = st.Digest, st.Size
		refused("name "+bad.Instance+"|"+bad.Name, bad, l, "not a staged image's name")
	}
	os.Remove(filepath.Join(edge.StagingDir(), st.Name))

	// Claims that disagree with the layer: refused before any lookup.
	st, l = stageBytes(t, edge, "image-7.erofs", []byte("seven"))
	l.Digest = gst.Digest
	refused("a layer whose digest is not the staged one's", st, l, "is not the layer's")
	os.Remove(filepath.Join(edge.StagingDir(), st.Name))

	// A symlink where the image should be, to a file of the apiserver's
	// host, with that file's digest.
	data, _ := os.ReadFile(secret)
	st, l = stageBytes(t, edge, "image-2.erofs", data)
	os.Remove(filepath.Join(edge.StagingDir(), st.Name))
	if err := os.Symlink(secret, filepath.Join(edge.StagingDir(), st.Name)); err != nil {
		t.Fatal(err)
	}
	refused("symlinked image", st, l, "not a regular file")

	// A staging directory that is a link, absolute or relative, to a
	// directory holding a file of the expected name.
	for i, target := range []string{t.TempDir(), filepath.Join("..", "elsewhere")} {
		st, l = stageBytes(t, edge, "image-3.erofs", data)
		os.Remove(filepath.Join(edge.StagingDir(), st.Name))
		real := target
		if !filepath.IsAbs(target) {
			real = filepath.Join(dir, outboxRoot, target)
			if err := os.MkdirAll(real, 0o700); err != nil {
				t.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(real, st.Name), data, 0o600); err != nil {
			t.Fatal(err)
		}
		st.Instance = "0123456789a" + strconv.Itoa(i)
		if err := os.Symlink(target, filepath.Join(dir, outboxRoot, st.Instance)); err != nil {
			t.Fatal(err)
		}
		refused("symlinked staging directory "+target, st, l, "the staging directory")
		if _, err := os.Stat(filepath.Join(real, st.Name)); err != nil {
			t.Errorf("the file the link led to: %v", err)
		}
		os.Remove(filepath.Join(dir, outboxRoot, st.Instance))
	}

	// A hard link to a file the stager did not make, with its digest.
	st, l = stageBytes(t, edge, "image-9.erofs", data)
	os.Remove(filepath.Join(edge.StagingDir(), st.Name))
	if err := os.Link(secret, filepath.Join(edge.StagingDir(), st.Name)); err != nil {
		t.Fatal(err)
	}
	refused("hard link", st, l, "with one name")
	if _, err := os.Stat(apisrv.BlobPath(st.Digest)); err == nil {
		t.Error("the secret's bytes are a blob")
	}

	// A FIFO and a device node: refused without opening them.
	st, l = stageBytes(t, edge, "image-4.erofs", []byte("fifo"))
	os.Remove(filepath.Join(edge.StagingDir(), st.Name))
	if err := syscall.Mkfifo(filepath.Join(edge.StagingDir(), st.Name), 0o600); err != nil {
		t.Fatal(err)
	}
	refused("FIFO", st, l, "not a regular file")
	if os.Geteuid() == 0 {
		st, l = stageBytes(t, edge, "image-10.erofs", []byte("device"))
		os.Remove(filepath.Join(edge.StagingDir(), st.Name))
		if err := syscall.Mknod(filepath.Join(edge.StagingDir(), st.Name), syscall.S_IFCHR|0o600, int(unix.Mkdev(1, 3))); err != nil {
			t.Fatal(err)
		}
		refused("device node", st, l, "not a regular file")
	}

	// Other bytes than the digest says: the genuine layer's digest over
	// forged content (what would poison every node using it), and a size
	// that is not the file's.
	forged := []byte(strings.Repeat("forged image ", 1077))
	st, l = stageBytes(t, edge, "image-5.erofs", forged)
	st.Digest, l.Digest = gst.Digest, gst.Digest
	refused("another layer's digest", st, l, "does not hold the bytes its stager says")
	if d, _, err := hashFile(apisrv.BlobPath(gst.Digest)); err != nil || d != gst.Digest {
		t.Errorf("the genuine blob after the forgery: %s %v", d, err)
	}
	st, l = stageBytes(t, edge, "image-6.erofs", forged)
	st.Size, l.SizeBytes = st.Size-1, l.SizeBytes-1
	refused("a size shorter than the file", st, l, "not a regular file of")

	// The image rewritten by its stager after the adoption (through a
	// descriptor it kept): the published blob does not change.
	good := []byte(strings.Repeat("good ", 2000))
	st, l = stageBytes(t, edge, "image-8.erofs", good)
	kept, err := os.OpenFile(filepath.Join(edge.StagingDir(), st.Name), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer kept.Close()
	if _, err := apisrv.Adopt(ctx, st, l); err != nil {
		t.Fatal(err)
	}
	if _, err := kept.WriteAt([]byte("EVIL"), 0); err != nil {
		t.Fatal(err)
	}
	if d, _, err := hashFile(apisrv.BlobPath(st.Digest)); err != nil || d != st.Digest {
		t.Errorf("the blob after its stager rewrote the staged image: %s %v, want %s", d, err, st.Digest)
	}

	// Every staged image that was looked at went, adopted or refused.
	assertStagingClean(t, dir)
	assertOutboxClean(t, dir)
}

// The staging left by a process gone is removed; only what held a
// build's files counts as an interrupted build (an idle process killed
// leaves its empty directory, which is not worth a word).
func TestSweepStagingCountsBuilds(t *testing.T) {
	root := t.TempDir()
	idle, cut := filepath.Join(root, "aaaaaaaaaaaa"), filepath.Join(root, "bbbbbbbbbbbb")
	for _, d := range []string{idle, cut} {
		if err := os.Mkdir(d, 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(d, stageLockName), nil, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(cut, "tree.tar"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(root, "old-build"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	n, err := sweepStaging(root)
	if err != nil || n != 2 {
		t.Fatalf("sweep: %d, %v; want 2 (the cut build and an old build's file)", n, err)
	}
	if left, _ := os.ReadDir(root); len(left) != 0 {
		t.Fatalf("left: %v", left)
	}
}
