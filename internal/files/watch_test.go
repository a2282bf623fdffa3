package files

import (
	"os"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/api"
	"github.com/dsecproject/dsec/internal/errdefs"
)

func TestDiff(t *testing.T) {
	file := func(ino uint64, size int64, mtime int64) node {
		return node{mode: unix.S_IFREG | 0o644, size: size, mtime: unix.Timespec{Sec: mtime}, dev: 1, ino: ino}
	}
	dir := func(ino uint64) node {
		return node{mode: unix.S_IFDIR | 0o755, dev: 1, ino: ino, mtime: unix.Timespec{Sec: 1}}
	}
	chmod := func(n node, perm uint32) node { n.mode = n.mode&unix.S_IFMT | perm; return n }
	for _, c := range []struct {
		name     string
		old, cur map[string]node
		want     string // "type name" joined by ", "
	}{
		{"nothing", map[string]node{"a": file(1, 1, 1)}, map[string]node{"a": file(1, 1, 1)}, ""},
		{"empty file created", nil, map[string]node{"a": file(1, 0, 1)}, "create a"},
		{"file created with content", nil, map[string]node{"a": file(1, 5, 1)}, "create a, write a"},
		{"removed", map[string]node{"a": file(1, 5, 1), "d": dir(2)}, nil, "remove a, remove d"},
		{"written in place", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": file(1, 5, 2)}, "write a"},
		{"grown", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": file(1, 6, 1)}, "write a"},
		{"replaced by a rename over it", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": file(9, 5, 1)}, "write a"},
		{"renamed", map[string]node{"a": file(1, 5, 1)}, map[string]node{"b": file(1, 5, 1)}, "rename a, create b"},
		{"renamed over another", map[string]node{"a": file(1, 5, 1), "b": file(2, 3, 1)}, map[string]node{"b": file(1, 5, 1)}, "rename a, write b"},
		{"directory renamed", map[string]node{"d": dir(2), "d/x": file(3, 1, 1)}, map[string]node{"e": dir(2), "e/x": file(3, 1, 1)},
			"rename d, rename d/x, create e, create e/x"},
		{"chmod", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": chmod(file(1, 5, 1), 0o600)}, "chmod a"},
		{"chmod of a directory, whose mtime moved", map[string]node{"d": dir(2)}, map[string]node{"d": chmod(node{mode: unix.S_IFDIR, dev: 1, ino: 2, mtime: unix.Timespec{Sec: 7}}, 0o700)}, "chmod d"},
		{"directory's children changed: no event for it", map[string]node{"d": dir(2)}, map[string]node{"d": {mode: unix.S_IFDIR | 0o755, dev: 1, ino: 2, mtime: unix.Timespec{Sec: 9}, size: 4096}, "d/n": file(5, 0, 1)}, "create d/n"},
		{"file became a directory", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": dir(1)}, "remove a, create a"},
		{"directory replaced", map[string]node{"d": dir(2)}, map[string]node{"d": dir(3)}, "remove d, create d"},
		{"owner changed", map[string]node{"a": file(1, 5, 1)}, map[string]node{"a": {mode: unix.S_IFREG | 0o644, size: 5, mtime: unix.Timespec{Sec: 1}, dev: 1, ino: 1, uid: 1000}}, "chmod a"},
	} {
		var got []string
		for _, ev := range diff(c.old, c.cur) {
			got = append(got, ev.Type+" "+ev.Name)
		}
		if strings.Join(got, ", ") != c.want {
			t.Errorf("%s: got %q, want %q", c.name, strings.Join(got, ", "), c.want)
		}
	}
}

func TestWatchPolls(t *testing.T) {
	f := newFixture(t)
	f.write(t, "/w/old", "old")
	f.write(t, "/w/sub/deep", "d")
	w, err := f.r.Watch("/w", 1, 100)
	must(t, err)
	if evs, err := w.Poll(); err != nil || len(evs) != 0 {
		t.Fatalf("a poll with no change: %v, %v", evs, err)
	}
	_, err = f.r.WriteFile("/w/new", strings.NewReader("hello"), 0o644, 0, nil)
	must(t, err)
	must(t, os.Rename(f.host("/w/old"), f.host("/w/renamed")))
	f.write(t, "/w/sub/deep", "not seen: too deep")
	evs, err := w.Poll()
	must(t, err)
	var got []string
	for _, ev := range evs {
		got = append(got, ev.Type+" "+ev.Name)
		switch {
		case ev.Type == api.FileEventRename && ev.Entry != nil:
			t.Errorf("the old name of a rename has an entry: %+v", ev)
		case ev.Type != api.FileEventRename && (ev.Entry == nil || ev.Entry.Path != "/w/"+ev.Name):
			t.Errorf("event %+v lacks the entry of /w/%s", ev, ev.Name)
		}
	}
	if want := "create new, write new, rename old, create renamed"; strings.Join(got, ", ") != want {
		t.Fatalf("events %q, want %q", strings.Join(got, ", "), want)
	}
	must(t, os.Chmod(f.host("/w/new"), 0o600))
	must(t, os.Remove(f.host("/w/renamed")))
	evs, err = w.Poll()
	must(t, err)
	if want := []api.FileEvent{{Name: "new", Type: api.FileEventChmod, Entry: evs[0].Entry}, {Name: "renamed", Type: api.FileEventRemove}}; !reflect.DeepEqual(evs, want) {
		t.Fatalf("events %+v, want %+v", evs, want)
	}

	// Recursive: the subdirectory's changes are seen, named from the top.
	rw, err := f.r.Watch("/w", 8, 100)
	must(t, err)
	f.write(t, "/w/sub/deep", "now seen")
	evs, err = rw.Poll()
	must(t, err)
	if len(evs) != 1 || evs[0].Name != "sub/deep" || evs[0].Type != api.FileEventWrite {
		t.Fatalf("recursive events %+v", evs)
	}

	// The watched directory gone ends the watch.
	must(t, os.RemoveAll(f.host("/w")))
	_, err = w.Poll()
	wantClass(t, err, errdefs.ErrNotFound)
}

func TestWatchBounds(t *testing.T) {
	f := newFixture(t)
	for i := range 5 {
		f.write(t, "/many/f"+strconv.Itoa(i), "x")
	}
	_, err := f.r.Watch("/many", 1, 4)
	wantClass(t, err, errdefs.ErrInvalid)
	if err == nil || !strings.Contains(err.Error(), "more than 4 entries") {
		t.Fatalf("error %v does not say what bound was passed", err)
	}
	w, err := f.r.Watch("/many", 1, 6)
	must(t, err)
	f.write(t, "/many/f5", "x")
	f.write(t, "/many/f6", "x")
	_, err = w.Poll()
	wantClass(t, err, errdefs.ErrInvalid)

	_, err = f.r.Watch("/nope", 1, 10)
	wantClass(t, err, errdefs.ErrNotFound)
	_, err = f.r.Watch("/many/f1", 1, 10)
	wantClass(t, err, errdefs.ErrInvalid)
}

// TestWatchStaysInside: a watch of a link to outside the root watches the
// clamped path inside it, and a recursive watch does not descend links.
func TestWatchStaysInside(t *testing.T) {
	f := newFixture(t)
	plantLinks(t, f)
	_, err := f.r.Watch("/abs", 1, 100)
	wantClass(t, err, errdefs.ErrNotFound)
	w, err := f.r.Watch("/", 64, 1000)
	must(t, err)
	for name := range w.last {
		if strings.Contains(name, "passwd") || strings.Contains(name, "secret") {
			t.Fatalf("the watch of / descended a link: %s", name)
		}
	}
}
