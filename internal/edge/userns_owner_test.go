package edge

import (
	"errors"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
	"github.com/dsecproject/dsec/internal/sandbox"
	"github.com/dsecproject/dsec/internal/sandbox/fake"
)

// TestUserNSOwners: each user-namespace sandbox gets an owner uid of its
// own from the range after the mapped IDs, a freed one is not given again
// at once, an adopted sandbox's owner stays taken, and a node whose every
// owner is taken refuses with resource_exhausted.
func TestUserNSOwners(t *testing.T) {
	const base = 1 << 30
	e, err := New(Config{Name: "n1", StateDir: t.TempDir(), Policy: sandbox.DefaultPolicy(), UserNSBase: base}, Deps{Backend: fake.New("container"), Blobs: &testImages{dir: t.TempDir()}})
	if err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	first := uint32(base + UserNSSize)
	o1, err1 := e.takeOwnerLocked()
	o2, err2 := e.takeOwnerLocked()
	if err1 != nil || err2 != nil || o1 != first || o2 != first+1 {
		t.Fatalf("first owners %d, %d (%v, %v); want %d, %d", o1, o2, err1, err2, first, first+1)
	}
	// A sandbox adopted at recovery keeps its owner: the next take skips it.
	adopted := &sbx{rec: record{UserNSOwner: first + 2}}
	e.listLocked("sb-n1-adopted", adopted)
	if o, _ := e.takeOwnerLocked(); o != first+3 {
		t.Fatalf("took %d while the adopted sandbox holds %d", o, first+2)
	}
	// Unlisting frees it; the search goes on from where it was.
	e.unlistLocked("sb-n1-adopted", adopted)
	if e.owners[first+2] {
		t.Fatal("an unlisted sandbox's owner is still taken")
	}
	if o, _ := e.takeOwnerLocked(); o != first+4 {
		t.Fatalf("took %d, want %d: a freed owner is not given again at once", o, first+4)
	}
	for len(e.owners) < UserNSSize {
		if _, err := e.takeOwnerLocked(); err != nil {
			t.Fatalf("with %d owners taken: %v", len(e.owners), err)
		}
	}
	if !e.owners[first+2] {
		t.Fatal("the freed owner was not taken again once the others were")
	}
	if _, err := e.takeOwnerLocked(); !errors.Is(err, errdefs.ErrExhausted) {
		t.Fatalf("with every owner taken: %v, want resource_exhausted", err)
	}
	for o := range e.owners {
		if o < first || o >= first+UserNSSize {
			t.Fatalf("owner %d outside [%d, %d)", o, first, first+UserNSSize)
		}
	}
}

// TestUserNSRanges: each owner's sandbox has an ID range of its own after
// the shared range and the owners', none two owners share, none crossing
// 2^32-1; an owner whose range would cross it gets none (the shared range).
func TestUserNSRanges(t *testing.T) {
	const base = 1_000_000_000
	e, err := New(Config{Name: "n1", StateDir: t.TempDir(), Policy: sandbox.DefaultPolicy(), UserNSBase: base}, Deps{Backend: fake.New("container"), Blobs: &testImages{dir: t.TempDir()}})
	if err != nil {
		t.Fatal(err)
	}
	owners := uint32(base + UserNSSize)
	if r := e.rangeOf(owners); r != base+2*UserNSSize {
		t.Fatalf("the first owner's range starts at %d, want %d", r, base+2*UserNSSize)
	}
	seen := map[uint32]bool{}
	var last uint32
	some, none := 0, 0
	for slot := uint32(0); slot < UserNSSize; slot++ {
		r := e.rangeOf(owners + slot)
		if r == 0 {
			none++
			continue
		}
		some++
		if seen[r] || r < base+2*UserNSSize || r <= last || uint64(r)+UserNSSize-1 > 1<<32-2 {
			t.Fatalf("slot %d: range %d (last %d)", slot, r, last)
		}
		seen[r], last = true, r
	}
	// floor((2^32-1 - 1,000,131,072) / 65,536) whole ranges fit.
	if some != 50275 || none != UserNSSize-50275 {
		t.Fatalf("%d owners with a range, %d without", some, none)
	}
	rec := record{UserNS: true, UserNSOwner: owners + 3, UserNSHost: e.rangeOf(owners + 3)}
	if m := e.userNSMapOf(&rec); m.HostID != base+5*UserNSSize || m.Size != UserNSSize {
		t.Fatalf("map of a sandbox with a range: %+v", m)
	}
	if m := e.userNSMapOf(&record{UserNS: true, UserNSOwner: owners}); m.HostID != base {
		t.Fatalf("map of a sandbox without one: %+v, want the shared range at %d", m, base)
	}
}
