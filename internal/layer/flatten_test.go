package layer

import (
	"context"
	"crypto/sha256"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func needRootForDiffs(t *testing.T) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root: mounts overlayfs, sets trusted.* xattrs, makes device nodes")
	}
}

// fsOps makes changes under a root directory, failing the test on error.
type fsOps struct {
	t    *testing.T
	root string
}

func (o fsOps) p(rel string) string { return filepath.Join(o.root, rel) }

func (o fsOps) must(err error) {
	o.t.Helper()
	if err != nil {
		o.t.Fatal(err)
	}
}

func (o fsOps) write(rel, data string) {
	o.t.Helper()
	o.must(os.MkdirAll(filepath.Dir(o.p(rel)), 0o755))
	o.must(os.WriteFile(o.p(rel), []byte(data), 0o644))
}

func (o fsOps) mkdir(rel string) { o.t.Helper(); o.must(os.MkdirAll(o.p(rel), 0o755)) }
func (o fsOps) rm(rel string)    { o.t.Helper(); o.must(os.RemoveAll(o.p(rel))) }

func (o fsOps) symlink(target, rel string) { o.t.Helper(); o.must(os.Symlink(target, o.p(rel))) }

func (o fsOps) xattr(rel, name, value string) {
	o.t.Helper()
	o.must(unix.Lsetxattr(o.p(rel), name, []byte(value), 0))
}

// overlayDiff mounts an overlay of lowers (topmost first) over a fresh
// upper, applies change to the merged view, unmounts, and returns the
// upper: an overlay diff exactly as Edge.Snapshot packs one.
func overlayDiff(t *testing.T, lowers []string, change func(fsOps)) string {
	t.Helper()
	dir := t.TempDir()
	upper, work, merged := filepath.Join(dir, "upper"), filepath.Join(dir, "work"), filepath.Join(dir, "merged")
	for _, d := range []string{upper, work, merged} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := MountOverlay(lowers, upper, work, merged); err != nil {
		t.Fatal(err)
	}
	defer func() {
		if err := UnmountOverlay(merged); err != nil {
			t.Fatal(err)
		}
	}()
	change(fsOps{t, merged})
	return upper
}

// overlayView mounts a read-only overlay of lowers (topmost first) and
// returns its description.
func overlayView(t *testing.T, lowers []string) map[string]string {
	t.Helper()
	target := t.TempDir()
	opts := []string{"lowerdir=" + strings.Join(lowers, ":")}
	for _, kv := range overlayOptions {
		opts = append(opts, kv[0]+"="+kv[1])
	}
	if err := unix.Mount("overlay", target, "overlay", unix.MS_RDONLY, strings.Join(opts, ",")); err != nil {
		t.Fatalf("mounting view of %v: %v", lowers, err)
	}
	defer func() {
		if err := UnmountOverlay(target); err != nil {
			t.Fatal(err)
		}
	}()
	return describe(t, target)
}

// describe maps every path under root (root itself excluded) to its type,
// permissions, owner, mtime, xattrs and content; for regular files also
// the link count. Atimes are left out: reading changes them.
func describe(t *testing.T, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, _ os.DirEntry, err error) error {
		if err != nil || p == root {
			return err
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			return err
		}
		s := fmt.Sprintf("type=%o perm=%o owner=%d:%d mtime=%d.%09d", st.Mode&unix.S_IFMT, st.Mode&0o7777,
			st.Uid, st.Gid, st.Mtim.Sec, st.Mtim.Nsec)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			s += fmt.Sprintf(" nlink=%d sha=%x", st.Nlink, sha256.Sum256(b))
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			s += " target=" + target
		case unix.S_IFCHR, unix.S_IFBLK:
			s += fmt.Sprintf(" rdev=%d:%d", unix.Major(st.Rdev), unix.Minor(st.Rdev))
		}
		names, err := listXattrs(unix.AT_FDCWD, p)
		if err != nil {
			return err
		}
		slices.Sort(names)
		for _, n := range names {
			v, err := getXattr(unix.AT_FDCWD, p, n)
			if err != nil {
				return err
			}
			s += fmt.Sprintf(" %s=%q", n, v)
		}
		out[strings.TrimPrefix(p, root)] = s
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func diffDescriptions(a, b map[string]string) []string {
	var out []string
	for p, v := range a {
		if w, ok := b[p]; !ok {
			out = append(out, fmt.Sprintf("%s: only in first: %s", p, v))
		} else if v != w {
			out = append(out, fmt.Sprintf("%s:\n\t%s\n\t%s", p, v, w))
		}
	}
	for p, w := range b {
		if _, ok := a[p]; !ok {
			out = append(out, fmt.Sprintf("%s: only in second: %s", p, w))
		}
	}
	slices.Sort(out)
	return out
}

func isWhiteout(t *testing.T, p string) bool {
	t.Helper()
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil {
		return false
	}
	return st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0
}

func isOpaque(t *testing.T, p string) bool {
	t.Helper()
	v, err := getXattr(unix.AT_FDCWD, p, opaqueXattr)
	if err != nil {
		t.Fatal(err)
	}
	return string(v) == "y"
}

func names(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		out = append(out, e.Name())
	}
	return out
}

var stamp = unix.NsecToTimespec(time.Date(2021, 2, 3, 4, 5, 6, 789, time.UTC).UnixNano())

func TestApplyDiff(t *testing.T) {
	needRootForDiffs(t)
	outside := t.TempDir()
	fsOps{t, outside}.write("victim", "untouched\n")
	fsOps{t, outside}.xattr("victim", "user.mark", "outside")

	cases := []struct {
		name  string
		base  func(fsOps)
		steps []func(fsOps)
		// check looks at the flattened diff and its view over base.
		check func(t *testing.T, flat string, view map[string]string)
	}{{
		name: "whiteout over file",
		base: func(o fsOps) { o.write("keep", "k"); o.write("gone", "g") },
		steps: []func(fsOps){
			func(o fsOps) { o.write("new1", "1"); o.write("f", "f") },
			func(o fsOps) { o.rm("f"); o.rm("gone") },
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			if !isWhiteout(t, flat+"/f") || !isWhiteout(t, flat+"/gone") {
				t.Errorf("want whiteouts at /f and /gone, have %v", names(t, flat))
			}
			if view["/f"] != "" || view["/gone"] != "" || view["/keep"] == "" || view["/new1"] == "" {
				t.Errorf("view: %v", view)
			}
		},
	}, {
		name: "whiteout over dir",
		base: func(o fsOps) { o.write("bd/a", "a"); o.write("bd/b", "b") },
		steps: []func(fsOps){
			func(o fsOps) { o.write("d/x", "x"); o.write("d/sub/y", "y"); o.write("bd/c", "c") },
			func(o fsOps) { o.rm("d"); o.rm("bd") },
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			if !isWhiteout(t, flat+"/d") || !isWhiteout(t, flat+"/bd") {
				t.Errorf("want whiteouts at /d and /bd, have %v", names(t, flat))
			}
			if len(view) != 0 {
				t.Errorf("view: %v", view)
			}
		},
	}, {
		name: "opaque dir replaces a dir with more entries",
		base: func(o fsOps) { o.write("o/x", "x"); o.write("o/y", "y"); o.write("o/z", "z") },
		steps: []func(fsOps){
			func(o fsOps) { o.write("o/w", "w"); o.write("o/deep/er", "e") },
			func(o fsOps) { o.rm("o"); o.mkdir("o"); o.write("o/only", "only") },
			func(o fsOps) { o.write("o/later", "later") },
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			if !isOpaque(t, flat+"/o") || !slices.Equal(names(t, flat+"/o"), []string{"later", "only"}) {
				t.Errorf("flat /o: opaque %v, entries %v", isOpaque(t, flat+"/o"), names(t, flat+"/o"))
			}
			if view["/o/x"] != "" || view["/o/w"] != "" || view["/o/only"] == "" || view["/o/later"] == "" {
				t.Errorf("view: %v", view)
			}
		},
	}, {
		name: "file replaces dir and dir replaces file",
		base: func(o fsOps) { o.write("p/a", "a"); o.write("q", "q"); o.write("r/a", "a"); o.write("r/b", "b") },
		steps: []func(fsOps){
			func(o fsOps) { o.write("p/b", "b"); o.rm("q"); o.rm("r") },
			func(o fsOps) {
				o.rm("p")
				o.write("p", "now a file")
				o.write("q/in", "in")
				// r was deleted a layer below: a directory made now sits
				// on that whiteout, and must not let base's r/a through.
				o.write("r/new", "new")
			},
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			if fi, err := os.Lstat(flat + "/p"); err != nil || !fi.Mode().IsRegular() {
				t.Errorf("flat /p: %v %v", fi, err)
			}
			for _, d := range []string{"/q", "/r"} {
				if !isOpaque(t, flat+d) {
					t.Errorf("flat %s replaces a whiteout but is not opaque", d)
				}
			}
			if view["/r/a"] != "" || view["/r/new"] == "" || view["/q/in"] == "" || view["/p/a"] != "" {
				t.Errorf("view: %v", view)
			}
		},
	}, {
		name: "metadata xattrs hard links and devices",
		base: func(o fsOps) { o.write("m/base", "b"); o.xattr("m", "user.fromBase", "1") },
		steps: []func(fsOps){
			func(o fsOps) {
				o.write("m/suid", "#!/bin/sh\n")
				o.must(os.Lchown(o.p("m/suid"), 1000, 1001))
				o.must(unix.Chmod(o.p("m/suid"), 0o4755))
				o.xattr("m/suid", "user.k", "v")
				o.xattr("m/suid", "trusted.t", "1")
				o.write("m/h1", "linked")
				o.must(os.Link(o.p("m/h1"), o.p("m/h2")))
				o.must(unix.Mknod(o.p("m/null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
				o.must(unix.Chmod(o.p("m/null"), 0o666))
				o.must(unix.Mkfifo(o.p("m/fifo"), 0o640))
				o.mkdir("m/d")
				o.must(os.Lchown(o.p("m/d"), 7, 8))
				o.must(os.Chmod(o.p("m/d"), 0o750))
				o.xattr("m/d", "user.d", "d")
				o.symlink("/etc/passwd", "m/abs")
				o.must(os.Lchown(o.p("m/abs"), 5, 6))
				o.xattr("m/abs", "trusted.link", "l")
				o.xattr("m", "user.fromStep1", "1")
				o.must(unix.UtimesNanoAt(unix.AT_FDCWD, o.p("m/abs"), []unix.Timespec{stamp, stamp}, unix.AT_SYMLINK_NOFOLLOW))
			},
			func(o fsOps) {
				o.must(unix.Chmod(o.p("m/suid"), 0o4750))
				o.xattr("m/suid", "user.k", "v2")
				o.must(unix.Lremovexattr(o.p("m/d"), "user.d"))
				o.xattr("m/d", "user.e", "e")
				o.must(unix.Lremovexattr(o.p("m"), "user.fromBase"))
				o.must(unix.UtimesNanoAt(unix.AT_FDCWD, o.p("m/d"), []unix.Timespec{stamp, stamp}, 0))
			},
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			var st unix.Stat_t
			if err := unix.Lstat(flat+"/m/suid", &st); err != nil || st.Mode&0o7777 != 0o4750 || st.Uid != 1000 || st.Gid != 1001 {
				t.Errorf("flat /m/suid: mode %o owner %d:%d %v", st.Mode&0o7777, st.Uid, st.Gid, err)
			}
			var h1, h2 unix.Stat_t
			if unix.Lstat(flat+"/m/h1", &h1) != nil || unix.Lstat(flat+"/m/h2", &h2) != nil || h1.Ino != h2.Ino {
				t.Errorf("flat /m/h1 and /m/h2 are not one file")
			}
			if !strings.Contains(view["/m"], "user.fromStep1") || strings.Contains(view["/m"], "user.fromBase") {
				t.Errorf("view /m: %s", view["/m"])
			}
			if !strings.Contains(view["/m/d"], `user.e="e"`) || strings.Contains(view["/m/d"], "user.d") {
				t.Errorf("view /m/d: %s", view["/m/d"])
			}
		},
	}, {
		name: "symlinks to outside are never followed",
		base: func(o fsOps) { o.mkdir("keep") },
		steps: []func(fsOps){
			func(o fsOps) {
				o.symlink(outside, "s")
				o.symlink(outside+"/victim", "v")
				o.symlink(outside, "w")
			},
			func(o fsOps) {
				o.rm("s")
				o.write("s/victim", "through the link?")
				o.xattr("v", "trusted.onlink", "1")
				o.must(unix.UtimesNanoAt(unix.AT_FDCWD, o.p("v"), []unix.Timespec{stamp, stamp}, unix.AT_SYMLINK_NOFOLLOW))
				o.rm("w")
			},
		},
		check: func(t *testing.T, flat string, view map[string]string) {
			if !isWhiteout(t, flat+"/w") || !isOpaque(t, flat+"/s") {
				t.Errorf("flat: %v", names(t, flat))
			}
		},
	}}

	erofs := false
	if _, err := exec.LookPath("mkfs.erofs"); err == nil {
		erofs = true
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			before := describe(t, outside)
			base := t.TempDir()
			tc.base(fsOps{t, base})
			stack := []string{base} // topmost first
			var diffs []string      // bottom first
			for _, step := range tc.steps {
				d := overlayDiff(t, stack, step)
				diffs = append(diffs, d)
				stack = append([]string{d}, stack...)
			}
			raw := make([]map[string]string, len(diffs))
			for i, d := range diffs {
				raw[i] = describe(t, d)
			}
			want := overlayView(t, stack)

			flat := t.TempDir()
			for _, d := range diffs {
				if err := ApplyDiff(flat, d); err != nil {
					t.Fatal(err)
				}
			}
			got := overlayView(t, []string{flat, base})
			if d := diffDescriptions(want, got); len(d) > 0 {
				t.Errorf("the flattened layer's view differs from the chain's:\n%s", strings.Join(d, "\n"))
			}
			tc.check(t, flat, got)
			for i, d := range diffs {
				if dd := diffDescriptions(raw[i], describe(t, d)); len(dd) > 0 {
					t.Errorf("ApplyDiff changed its input %d:\n%s", i, strings.Join(dd, "\n"))
				}
			}
			if dd := diffDescriptions(before, describe(t, outside)); len(dd) > 0 {
				t.Errorf("ApplyDiff changed a directory outside dst:\n%s", strings.Join(dd, "\n"))
			}

			// The edge flattens from EROFS mounts of the snapshot
			// layers: their whiteouts and opaque dirs must read the same.
			if !erofs {
				t.Log("mkfs.erofs not in PATH: not flattening from EROFS images")
				return
			}
			s, _ := newTestStore(t)
			m := NewMounter(filepath.Join(t.TempDir(), "mnt"), s, nil)
			flat2 := t.TempDir()
			for i, d := range diffs {
				l, err := s.BuildFromDir(context.Background(), mustRef(t, fmt.Sprintf("toolkit/step:%d", i)), d, BuildOptions{}, nil)
				if err != nil {
					t.Fatal(err)
				}
				if err := ApplyDiff(flat2, acquire(t, m, l.Digest)); err != nil {
					t.Fatal(err)
				}
			}
			if d := diffDescriptions(want, overlayView(t, []string{flat2, base})); len(d) > 0 {
				t.Errorf("flattened from EROFS, the view differs from the chain's:\n%s", strings.Join(d, "\n"))
			}
		})
	}
}

func TestApplyDiffExcluding(t *testing.T) {
	needRootForDiffs(t)
	base := t.TempDir()
	fsOps{t, base}.write("skip/old", "old")
	fsOps{t, base}.write("opq/x", "x")
	lower := overlayDiff(t, []string{base}, func(o fsOps) { o.write("skip/mid", "mid") })
	upper := overlayDiff(t, []string{lower, base}, func(o fsOps) {
		o.write("keep/a", "a")
		o.rm("skip")
		o.write("skip/new", "new")
		o.rm("opq")
		o.write("opq/in", "in")
		o.write("opq/secret", "s")
	})
	flat := t.TempDir()
	if err := ApplyDiff(flat, lower); err != nil {
		t.Fatal(err)
	}
	if err := ApplyDiffExcluding(flat, upper, []string{"/skip", "/opq/secret/"}); err != nil {
		t.Fatal(err)
	}
	if !isOpaque(t, flat+"/opq") {
		t.Errorf("flat /opq is not opaque")
	}
	view := overlayView(t, []string{flat, base})
	for p, want := range map[string]bool{"/keep/a": true, "/skip/old": true, "/skip/mid": true, "/skip/new": false,
		"/opq/in": true, "/opq/secret": false, "/opq/x": false} {
		if _, ok := view[p]; ok != want {
			t.Errorf("%s present = %v, want %v", p, ok, want)
		}
	}
}

func TestApplyDiffErrors(t *testing.T) {
	dir := t.TempDir()
	if err := ApplyDiff(dir, filepath.Join(dir, "missing")); err == nil {
		t.Error("ApplyDiff from a missing diff succeeded")
	}
	link := filepath.Join(t.TempDir(), "link")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	if err := ApplyDiff(link, dir); err == nil {
		t.Error("ApplyDiff onto a symlink succeeded")
	}
}

// Overlayfs never puts a plain directory over a lower symlink, but a diff
// that does must not write through dst's symlink.
func TestApplyDiffNeverFollowsDstSymlinks(t *testing.T) {
	needRootForDiffs(t)
	outside := t.TempDir()
	fsOps{t, outside}.write("victim", "untouched\n")
	before := describe(t, outside)
	dst, diff := t.TempDir(), t.TempDir()
	fsOps{t, dst}.symlink(outside, "s")
	fsOps{t, dst}.symlink(outside+"/victim", "f")
	fsOps{t, diff}.write("s/victim", "written")
	fsOps{t, diff}.must(unix.Mknod(diff+"/f", unix.S_IFCHR, 0))
	if err := ApplyDiff(dst, diff); err != nil {
		t.Fatal(err)
	}
	if dd := diffDescriptions(before, describe(t, outside)); len(dd) > 0 {
		t.Errorf("ApplyDiff wrote through a symlink of dst:\n%s", strings.Join(dd, "\n"))
	}
	if !isOpaque(t, dst+"/s") || !isWhiteout(t, dst+"/f") || readFile(t, dst+"/s/victim") != "written" {
		t.Errorf("dst: /s opaque %v, /f whiteout %v", isOpaque(t, dst+"/s"), isWhiteout(t, dst+"/f"))
	}
}
