package image

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// splitLayers is four layers: two base layers, then two whose changes
// exercise every kind of diff an upper directory holds.
func splitLayers(t *testing.T) [][]byte {
	t.Helper()
	etc := dir("etc/")
	etc.hdr.Mode = 0o750
	return [][]byte{
		layerTar(t,
			dir("./"),
			etc,
			file("etc/hostname", "base"),
			file("etc/gone", "deleted by layer 2"),
			file("etc/keep", "v1"),
			dir("opq/"),
			file("opq/old", "hidden by layer 2"),
			dir("opq/sub/"),
			file("opq/sub/deep", "hidden by layer 2"),
			dir("usr/"), dir("usr/bin/"),
			file("usr/bin/tool", "tool"),
			symlink("bin", "usr/bin"),
			dir("lib/"),
			file("lib/x", "deleted with lib"),
			file("replaced-file", "becomes a directory"),
			dir("replaced-dir/"),
			file("replaced-dir/inner", "goes with its directory"),
			dir("hard/"),
			file("hard/target", "linked from above"),
		),
		layerTar(t, file("etc/keep", "v2")),
		layerTar(t,
			whiteoutEntry("etc/.wh.gone"),
			whiteoutEntry(".wh.lib"),
			file("opq/.wh..wh..opq", ""),
			file("opq/new", "new"),
			file("bin/via-link", "through the base's symlink"),
			hardlink("hard/link", "hard/target"),
			dir("replaced-file/"),
			file("replaced-file/inner", "inner"),
			file("replaced-dir", "a file now"),
			dir("newdir/"),
			file("newdir/file", "deleted by layer 3"),
			file("etc/hostname", "upper"),
		),
		layerTar(t,
			dir("lib/"),
			file("lib/y", "lib is back, without x"),
			whiteoutEntry("newdir/.wh.file"),
			whiteoutEntry(".wh.replaced-file"),
			whiteoutEntry("etc/.wh.keep"),
		),
	}
}

func TestUnpackSplitIsAnOverlayDiff(t *testing.T) {
	needRoot(t, "sets trusted.overlay.opaque")
	layers := splitLayers(t)

	flat := filepath.Join(t.TempDir(), "flat")
	must(t, os.Mkdir(flat, 0o755))
	img := buildImage(t, "amd64", true, layers...)
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, flat, Options{})
	must(t, err)

	f := newFixture(t)
	res, err := Unpack(t.Context(), p, f.dest, Options{SplitAt: 2, UpperDir: f.upper})
	must(t, err)
	if len(res.Layers) != 4 {
		t.Fatalf("layers = %d, want 4", len(res.Layers))
	}
	f.checkOutside(t)

	// The base holds the first two layers only.
	if got := readFile(t, f.path("etc/keep")); got != "v2" {
		t.Errorf("base etc/keep = %q", got)
	}
	if got := readFile(t, f.path("etc/gone")); got != "deleted by layer 2" {
		t.Errorf("base etc/gone = %q", got)
	}

	// The upper holds the changes, in overlayfs's own representation.
	up := func(s string) string { return filepath.Join(f.upper, s) }
	for _, wh := range []string{"etc/gone", "etc/keep", "replaced-file"} {
		var st unix.Stat_t
		if err := unix.Lstat(up(wh), &st); err != nil || !isWhiteout(&st) {
			t.Errorf("upper %s is not a whiteout: mode %o rdev %d, %v", wh, st.Mode, st.Rdev, err)
		}
	}
	for _, opaque := range []string{"opq", "lib"} {
		if v, _ := getXattr(up(opaque), opaqueXattr); string(v) != "y" {
			t.Errorf("upper %s is not opaque (%q)", opaque, v)
		}
	}
	if v, _ := getXattr(up("etc"), opaqueXattr); v != nil {
		t.Errorf("upper etc is opaque; it should merge with the base's")
	}
	if _, err := os.Lstat(up("lib/x")); !os.IsNotExist(err) {
		t.Errorf("upper lib/x exists: %v", err)
	}
	if _, err := os.Lstat(up("newdir/file")); !os.IsNotExist(err) {
		t.Errorf("upper newdir/file should be gone without a whiteout (the base never had it): %v", err)
	}
	if got := readFile(t, up("usr/bin/via-link")); got != "through the base's symlink" {
		t.Errorf("write through the base's bin symlink: %q", got)
	}
	if _, err := os.Lstat(up("bin")); !os.IsNotExist(err) {
		t.Errorf("upper has bin, shadowing the base's symlink: %v", err)
	}
	if got := readFile(t, up("hard/link")); got != "linked from above" {
		t.Errorf("hard link to a base file: %q", got)
	}
	// Directories copied up keep the base's metadata, as overlayfs does.
	var be, ue unix.Stat_t
	must(t, unix.Lstat(f.path("etc"), &be))
	must(t, unix.Lstat(up("etc"), &ue))
	if be.Mode != ue.Mode || be.Uid != ue.Uid || be.Mtim != ue.Mtim {
		t.Errorf("copied-up etc: mode %o mtime %v, base has %o %v", ue.Mode, ue.Mtim, be.Mode, be.Mtim)
	}

	// The proof: the kernel's overlay of upper on base shows exactly the
	// flat unpack of all four layers.
	mnt := t.TempDir()
	if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, "lowerdir="+f.upper+":"+f.dest); err != nil {
		t.Skipf("overlayfs mount unavailable (%v): upper checked by hand only", err)
	}
	defer unix.Unmount(mnt, unix.MNT_DETACH)
	want, got := describeTree(t, flat, true), describeTree(t, mnt, true)
	if !slices.Equal(want, got) {
		t.Errorf("overlay differs from the flat unpack:\nflat:\n  %s\noverlay:\n  %s",
			strings.Join(want, "\n  "), strings.Join(got, "\n  "))
	}
}

// An upper layer's symlink trick must not escape either: resolution in
// the merged view is clamped just like in a plain tree.
func TestUnpackSplitHostile(t *testing.T) {
	needRoot(t, "sets trusted.overlay.opaque")
	f := newFixture(t)
	img := buildImage(t, "amd64", true,
		layerTar(t, symlink("host", f.outside), symlink("up", "../../../..")),
		layerTar(t,
			file("host/secret", "pwned"),
			file("up/"+strings.TrimPrefix(f.secret, "/"), "pwned"),
			whiteoutEntry("host/.wh.etc"),
			hardlink("l", "host/secret"),
			file("host/.wh..wh..opq", "")),
	)
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	_, err := Unpack(t.Context(), p, f.dest, Options{SplitAt: 1, UpperDir: f.upper})
	must(t, err)
	inside := filepath.Join(f.upper, f.secret)
	if got := readFile(t, inside); got != "pwned" {
		t.Errorf("write through the base's host link should land at %s in the upper: %q", inside, got)
	}
	f.checkOutside(t)

	_, err = Unpack(t.Context(), p, t.TempDir(), Options{SplitAt: 1, UpperDir: f.upper})
	wantClass(t, err, errdefs.ErrPrecondition) // upper not empty any more
}

// A merge threshold cuts the image into runs: the first a plain tree, each
// later one an upper directory over all the runs below it. Stacked by the
// kernel, the sealed runs must show exactly the flat image, whatever the
// cut: every layer a run of its own (two folds of the plain tree), or two
// runs of two.
func TestUnpackMergeUnderRunsStackToTheFlatImage(t *testing.T) {
	needRoot(t, "sets trusted.overlay.opaque and mounts overlayfs")
	layers := splitLayers(t)
	img := buildImage(t, "amd64", true, layers...)
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	flat := filepath.Join(t.TempDir(), "flat")
	must(t, os.Mkdir(flat, 0o755))
	_, err := Unpack(t.Context(), p, flat, Options{})
	must(t, err)
	size := func(i int) int64 { return int64(len(img.layers[i])) }

	for _, tc := range []struct {
		name      string
		threshold int64
		want      []Group
	}{
		{"one run per layer", 1, []Group{{0, 1, size(0)}, {1, 2, size(1)}, {2, 3, size(2)}, {3, 4, size(3)}}},
		{"two runs of two", size(0) + size(1), []Group{{0, 2, size(0) + size(1)}, {2, 4, size(2) + size(3)}}},
		{"one run", 1 << 30, []Group{{0, 4, size(0) + size(1) + size(2) + size(3)}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if tc.name == "two runs of two" && size(2)+size(3) > tc.threshold {
				t.Skipf("layers 2 and 3 (%d bytes) do not fit under %d", size(2)+size(3), tc.threshold)
			}
			f := newFixture(t)
			keep := t.TempDir()
			var sealed []string
			res, err := Unpack(t.Context(), p, f.dest, Options{MergeUnder: tc.threshold, UpperDir: f.upper,
				Sealed: func(run, runs int, dir string) error {
					if run != len(sealed) || runs != len(tc.want) {
						t.Errorf("Sealed(%d, %d) after %d runs sealed, want %d runs", run, runs, len(sealed), len(tc.want))
					}
					cp := filepath.Join(keep, strconv.Itoa(run))
					if out, err := exec.Command("cp", "-a", dir, cp).CombinedOutput(); err != nil {
						return fmt.Errorf("copying run %d: %v: %s", run, err, out)
					}
					sealed = append(sealed, cp)
					return nil
				}})
			must(t, err)
			if !slices.Equal(res.Runs, tc.want) {
				t.Fatalf("runs = %v, want %v", res.Runs, tc.want)
			}
			if len(res.Layers) != 4 {
				t.Errorf("result lists %d layers, want 4 (each once)", len(res.Layers))
			}
			if len(sealed) != len(tc.want)-1 {
				t.Fatalf("%d runs sealed, want all but the last (%d)", len(sealed), len(tc.want)-1)
			}
			if want := f.dest; len(tc.want) > 1 {
				want = filepath.Join(f.upper, "run-"+strconv.Itoa(len(tc.want)-1))
				if res.Top != want {
					t.Errorf("top = %s, want %s", res.Top, want)
				}
			} else if res.Top != want {
				t.Errorf("top = %s, want the destination", res.Top)
			}
			if ents, _ := os.ReadDir(f.upper); len(tc.want) > 1 && len(ents) != 1 {
				t.Errorf("upper directory holds %d entries; sealed runs should be gone, only the top left", len(ents))
			}
			f.checkOutside(t)

			lowers := []string{res.Top}
			for i := len(sealed) - 1; i >= 0; i-- {
				lowers = append(lowers, sealed[i])
			}
			mnt := t.TempDir()
			opt := "lowerdir=" + strings.Join(lowers, ":")
			if len(lowers) == 1 {
				// One lower alone is not an overlay: compare the tree.
				mnt = lowers[0]
			} else if err := unix.Mount("overlay", mnt, "overlay", unix.MS_RDONLY, opt); err != nil {
				t.Fatalf("mounting the runs: %v", err)
			} else {
				defer unix.Unmount(mnt, unix.MNT_DETACH)
			}
			want, got := describeTree(t, flat, true), describeTree(t, mnt, true)
			if !slices.Equal(want, got) {
				t.Errorf("stacked runs differ from the flat unpack:\nflat:\n  %s\nstacked:\n  %s",
					strings.Join(want, "\n  "), strings.Join(got, "\n  "))
			}
		})
	}
}

func TestUnpackMergeUnderRefusals(t *testing.T) {
	needRoot(t, "sets trusted.overlay.opaque")
	layers := splitLayers(t)
	img := buildImage(t, "amd64", true, layers...)
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	sealed := func(int, int, string) error { return nil }
	f := newFixture(t)
	for _, opts := range []Options{
		{MergeUnder: 1, SplitAt: 1, UpperDir: f.upper, Sealed: sealed},
		{MergeUnder: -1, UpperDir: f.upper, Sealed: sealed},
		{MergeUnder: 1, Sealed: sealed},
		{MergeUnder: 1, UpperDir: f.upper},
	} {
		_, err := Unpack(t.Context(), p, f.dest, opts)
		wantClass(t, err, errdefs.ErrInvalid)
	}
	// What Sealed refuses ends the unpack with its error.
	boom := errors.New("no room for run 1")
	_, err := Unpack(t.Context(), p, f.dest, Options{MergeUnder: 1, UpperDir: f.upper,
		Sealed: func(run, _ int, _ string) error {
			if run == 1 {
				return boom
			}
			return nil
		}})
	if !errors.Is(err, boom) {
		t.Fatalf("Sealed's error: got %v", err)
	}
}

// Copy-ups count against the data limit: an upper run of hard links to a
// lower's files writes those files again.
func TestUnpackCopyUpsCountAgainstTheLimit(t *testing.T) {
	needRoot(t, "sets trusted.overlay.opaque")
	big := strings.Repeat("x", 100_000)
	var lower, upper []entry
	lower = append(lower, dir("d/"))
	for i := range 5 {
		name := fmt.Sprintf("d/f%d", i)
		lower = append(lower, file(name, big))
		upper = append(upper, hardlink(fmt.Sprintf("l%d", i), name))
	}
	img := buildImage(t, "amd64", true, layerTar(t, lower...), layerTar(t, upper...))
	p := ociLayout(t, filepath.Join(t.TempDir(), "image.tar"), img)
	f := newFixture(t)
	_, err := Unpack(t.Context(), p, f.dest, Options{SplitAt: 1, UpperDir: f.upper, MaxBytes: 700_000})
	wantClass(t, err, errdefs.ErrInvalid)
	if err != nil && !strings.Contains(err.Error(), "copying up") {
		t.Errorf("refused for another reason: %v", err)
	}
	f2 := newFixture(t)
	if _, err := Unpack(t.Context(), p, f2.dest, Options{SplitAt: 1, UpperDir: f2.upper, MaxBytes: 1_100_000}); err != nil {
		t.Errorf("within the limit: %v", err)
	}
	// An image without layers, merged: one empty run.
	empty := ociLayout(t, filepath.Join(t.TempDir(), "empty.tar"), buildImage(t, "amd64", true))
	f3 := newFixture(t)
	res, err := Unpack(t.Context(), empty, f3.dest, Options{MergeUnder: 1, UpperDir: f3.upper, Sealed: func(int, int, string) error { return nil }})
	if err != nil || len(res.Runs) != 1 || res.Top != f3.dest {
		t.Errorf("image without layers: %+v, %v", res, err)
	}
}
