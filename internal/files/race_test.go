package files

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// flip atomically exchanges two host paths (a real directory and a symlink
// pointing outside the root) as fast as it can, as a sandbox racing our
// checks would, until the returned stop is called.
func flip(a, b string) (stop func()) {
	done := make(chan struct{})
	var wg sync.WaitGroup
	wg.Add(1)
	go func() {
		defer wg.Done()
		for {
			select {
			case <-done:
				return
			default:
			}
			unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE)
		}
	}()
	return func() { close(done); wg.Wait() }
}

func raceDuration() time.Duration {
	if testing.Short() {
		return 300 * time.Millisecond
	}
	return 1500 * time.Millisecond
}

func TestRaceDirSwappedForSymlink(t *testing.T) {
	f := newFixture(t)
	// Three directories that keep turning into symlinks out of the root:
	// absolute, relative, and one level down in a stable directory.
	f.write(t, "/d/secret", "inside")
	f.symlink(t, f.outside, "/d-alt")
	f.write(t, "/e/secret", "inside")
	f.symlink(t, "../outside", "/e-alt")
	f.write(t, "/x/sub/secret", "inside")
	f.symlink(t, f.outside, "/x/sub-alt")
	for _, pair := range [][2]string{{"/d", "/d-alt"}, {"/e", "/e-alt"}, {"/x/sub", "/x/sub-alt"}} {
		defer flip(f.host(pair[0]), f.host(pair[1]))()
	}

	archive := mkTar(t,
		file("secret", "pwned"),
		dir("tdir", 0755),
		file("tdir/f", "pwned"),
		symlink("tl", f.outside),
		hardlink("hl", "secret"),
	)
	var reads, writes, extracts int
	deadline := time.Now().Add(raceDuration())
	for time.Now().Before(deadline) {
		for _, base := range []string{"/d", "/e", "/x/sub"} {
			if got, err := readAll(t, f.r, base+"/secret"); err == nil {
				if strings.Contains(got, secret) {
					t.Fatalf("ReadFile(%s/secret) read the host's secret", base)
				}
				reads++
			}
			if _, err := f.r.WriteFile(base+"/secret", strings.NewReader("pwned"), 0644, 0, nil); err == nil {
				writes++
			}
			f.r.WriteFile(base+"/new/deep/file", strings.NewReader("pwned"), 0644, 0, nil)
			if _, err := f.r.ExtractTar(base, bytes.NewReader(archive), TarOptions{}); err == nil {
				extracts++
			}
			if es, err := f.r.List(base, 5); err == nil {
				for _, e := range es {
					if strings.HasSuffix(e.Path, "/passwd") {
						t.Fatalf("List(%s) reached outside: %s", base, e.Path)
					}
				}
			}
			var buf bytes.Buffer
			if f.r.WriteTar(base, &buf) == nil && bytes.Contains(buf.Bytes(), []byte(secret)) {
				t.Fatalf("WriteTar(%s) archived the host's secret", base)
			}
			f.r.Stat(base + "/secret")
			f.r.Remove(base+"/new", true)
			f.r.Remove(base+"/tdir", true)
			f.r.Remove(base+"/hl", false)
		}
	}
	t.Logf("succeeded while racing: %d reads, %d writes, %d extractions", reads, writes, extracts)
	if reads == 0 || writes == 0 || extracts == 0 {
		t.Error("an operation never succeeded: the race exercised nothing")
	}
	// The fixture's cleanup checks nothing outside the root changed.
}

func TestRaceRecursiveRemove(t *testing.T) {
	f := newFixture(t)
	n := 60
	if testing.Short() {
		n = 10
	}
	for i := range n {
		for _, p := range []string{"/victim/a/f1", "/victim/a/b/f2", "/victim/a/b/c/f3", "/victim/z"} {
			f.write(t, p, "x")
		}
		f.symlink(t, f.outside, "/alt")
		// Its flipper uses a host path through /victim/a, which is at times
		// the link to outside; there it finds no b or b-alt and does nothing.
		f.symlink(t, "../../outside", "/victim/a/b-alt")
		stop1 := flip(f.host("/victim/a"), f.host("/alt"))
		stop2 := flip(f.host("/victim/a/b"), f.host("/victim/a/b-alt"))
		err := f.r.Remove("/victim", true)
		stop1()
		stop2()
		if err != nil {
			t.Logf("iteration %d: %v", i, err)
		}
		must(t, os.RemoveAll(f.host("/alt")))
		must(t, os.RemoveAll(f.host("/victim")))
		if _, err := os.Stat(f.secret); err != nil {
			t.Fatalf("iteration %d: secret gone: %v", i, err)
		}
		if _, err := os.Stat(filepath.Join(f.outside, "dir", "passwd")); err != nil {
			t.Fatalf("iteration %d: outside file gone: %v", i, err)
		}
	}
}
