package layer

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

// A lower layer (BuildBlob) has no entry of its own: its pin keeps it
// until the base naming it is written, the base keeps it after that, and
// deleting the base takes it along.
func TestLowerLayersLiveWithTheBaseNamingThem(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	ctx := context.Background()
	never := func(string) (bool, error) { return false, nil }

	src := filepath.Join(t.TempDir(), "lower")
	writeTree(t, src, baseTree)
	low, size, unpin, err := s.BuildBlob(ctx, src, BuildOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if !IsDigest(low) || size <= 0 {
		t.Fatalf("BuildBlob = %s, %d", low, size)
	}
	if gone, err := s.Collect(low); err != nil || gone {
		t.Fatalf("Collect of a pinned lower layer: removed %v, %v", gone, err)
	}

	top := filepath.Join(t.TempDir(), "top")
	writeTree(t, top, workspaceTree)
	ref := mustRef(t, "base/merged:1")
	l, err := s.BuildFromDir(ctx, ref, top, BuildOptions{Lowers: []string{low}}, nil)
	unpin()
	if err != nil {
		t.Fatal(err)
	}
	if len(l.Lowers) != 1 || l.Lowers[0] != low {
		t.Fatalf("entry lowers = %v", l.Lowers)
	}
	if r, err := s.Resolve(ref.String()); err != nil || len(r.Lowers) != 1 {
		t.Fatalf("Resolve = %+v, %v", r, err)
	}
	if gone, err := s.Collect(low); err != nil || gone {
		t.Fatalf("Collect of a lower layer a base names: removed %v, %v", gone, err)
	}
	if removed, _, err := s.GC(never); err != nil || len(removed) != 0 {
		t.Fatalf("GC removed %v (%v); the base names both blobs", removed, err)
	}

	if err := s.Delete(ref.String(), never); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{l.Digest, low} {
		if _, err := os.Stat(s.BlobPath(d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("blob %s kept after the base was deleted: %v", d, err)
		}
	}
}

func TestLowerLayersRefused(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	ctx := context.Background()
	dir := filepath.Join(t.TempDir(), "tree")
	writeTree(t, dir, workspaceTree)
	missing := "sha256:0000000000000000000000000000000000000000000000000000000000000000"
	many := make([]string, MaxLowers+1)
	for i := range many {
		many[i] = missing
	}
	for _, tc := range []struct {
		ref    string
		lowers []string
	}{
		{"workspace/w:1", []string{missing}}, // only bases sit on lowers
		{"base/b:1", []string{"sha256:nothex"}},
		{"base/b:1", []string{"../../etc/passwd"}},
		{"base/b:1", many},
		{"base/b:1", []string{missing, missing}}, // a node mounts a digest once
		{"base/b:1", []string{missing}},          // not stored: refused, not invalid input
	} {
		_, err := s.BuildFromDir(ctx, mustRef(t, tc.ref), dir, BuildOptions{Lowers: tc.lowers}, nil)
		if len(tc.lowers) == 1 && tc.lowers[0] == missing && tc.ref == "base/b:1" {
			if err == nil || !strings.Contains(err.Error(), "gone") {
				t.Errorf("a lower not stored: %v", err)
			}
		} else if !errors.Is(err, errdefs.ErrInvalid) {
			t.Errorf("%s on %d lowers %.20q: %v, want invalid", tc.ref, len(tc.lowers), tc.lowers[0], err)
		}
		if _, err := s.Resolve(tc.ref); !errors.Is(err, errdefs.ErrNotFound) {
			t.Errorf("%s refused but in the catalog: %v", tc.ref, err)
		}
	}
	if _, err := s.Collect("nope"); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("Collect(nope): %v", err)
	}
	// A top with the content of one of its lowers could not be stacked.
	low, _, unpin, err := s.BuildBlob(ctx, dir, BuildOptions{}, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer unpin()
	if _, err := s.BuildFromDir(ctx, mustRef(t, "base/same:1"), dir, BuildOptions{Lowers: []string{low}}, nil); !errors.Is(err, errdefs.ErrInvalid) {
		t.Errorf("a top equal to its lower: %v", err)
	}
}

// One top digest on two different stacks is two filesystems: a lookup by
// digest refuses to pick.
func TestGetByDigestOfTopsOnDifferentLowers(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	ctx := context.Background()
	lowA := filepath.Join(t.TempDir(), "a")
	writeTree(t, lowA, baseTree)
	lowB := filepath.Join(t.TempDir(), "b")
	writeTree(t, lowB, append([]node{{path: "etc/other", data: "b"}}, baseTree...))
	top := filepath.Join(t.TempDir(), "top")
	writeTree(t, top, workspaceTree)
	var tops []string
	for i, dir := range []string{lowA, lowB} {
		d, _, unpin, err := s.BuildBlob(ctx, dir, BuildOptions{}, nil)
		if err != nil {
			t.Fatal(err)
		}
		l, err := s.BuildFromDir(ctx, mustRef(t, fmt.Sprintf("base/top%d:1", i)), top, BuildOptions{Lowers: []string{d}}, nil)
		unpin()
		if err != nil {
			t.Fatal(err)
		}
		tops = append(tops, l.Digest)
	}
	if tops[0] != tops[1] {
		t.Fatalf("the same top tree sealed to two digests: %v", tops)
	}
	if _, err := s.Get(tops[0]); !errors.Is(err, errdefs.ErrPrecondition) {
		t.Errorf("Get(digest) of one top on two stacks: %v", err)
	}
	if l, err := s.Get("base/top1:1"); err != nil || len(l.Lowers) != 1 {
		t.Errorf("Get(ref): %+v, %v", l, err)
	}
}

// A snapshot names the layers it was taken on: deleting their refs keeps
// the blobs for it, and deleting it last takes them.
func TestSnapshotKeepsTheBlobsBelowIt(t *testing.T) {
	needRootAndMkfs(t)
	s, _ := newTestStore(t)
	ctx := context.Background()
	never := func(string) (bool, error) { return false, nil }
	base := buildTree(t, s, "base/under:1", baseTree)
	dir := filepath.Join(t.TempDir(), "diff")
	writeTree(t, dir, workspaceTree)
	snap, err := s.BuildFromDir(ctx, mustRef(t, "snapshot/s:1"), dir,
		BuildOptions{Snapshot: &api.SnapshotInfo{Sandbox: "sb-x", Layers: []string{base}}}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Delete("base/under:1", never); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(s.BlobPath(base)); err != nil {
		t.Fatalf("the base's blob went with its ref while a snapshot stands on it: %v", err)
	}
	if err := s.Delete("snapshot/s:1", never); err != nil {
		t.Fatal(err)
	}
	for _, d := range []string{base, snap.Digest} {
		if _, err := os.Stat(s.BlobPath(d)); !errors.Is(err, os.ErrNotExist) {
			t.Errorf("blob %s kept after the snapshot was deleted: %v", d, err)
		}
	}
}
