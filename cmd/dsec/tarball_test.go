package main

import (
	"archive/tar"
	"bytes"
	"compress/gzip"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func TestTarRoundTrip(t *testing.T) {
	src := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(src, "bin", "deep"), 0o755))
	must(os.WriteFile(filepath.Join(src, "bin", "run.sh"), []byte("#!/bin/sh\necho hi\n"), 0o755))
	must(os.WriteFile(filepath.Join(src, "data.txt"), []byte("data"), 0o640))
	must(os.Symlink("bin/run.sh", filepath.Join(src, "link")))
	must(os.Symlink("/etc/passwd", filepath.Join(src, "abs-link")))
	must(os.Link(filepath.Join(src, "data.txt"), filepath.Join(src, "bin", "deep", "hard.txt")))
	must(os.Mkdir(filepath.Join(src, "ro"), 0o755))
	must(os.WriteFile(filepath.Join(src, "ro", "f"), []byte("x"), 0o644))
	must(os.Chmod(filepath.Join(src, "ro"), 0o555))
	t.Cleanup(func() { os.Chmod(filepath.Join(src, "ro"), 0o755) })

	var buf bytes.Buffer
	st, err := writeTarDir(&buf, src)
	must(err)
	if st.Entries != 9 { // bin, bin/deep, hard.txt, run.sh, data.txt, link, abs-link, ro, ro/f
		t.Errorf("wrote %d entries", st.Entries)
	}
	tarBytes := buf.Bytes()

	// The archive holds relative names only, and the hard link as a link.
	tr := tar.NewReader(bytes.NewReader(tarBytes))
	links := 0
	for {
		h, err := tr.Next()
		if err != nil {
			break
		}
		if strings.HasPrefix(h.Name, "/") || strings.HasPrefix(h.Name, ".") {
			t.Errorf("entry name %q", h.Name)
		}
		if h.Typeflag == tar.TypeLink {
			links++
		}
	}
	if links != 1 {
		t.Errorf("%d hard links in archive", links)
	}

	dst := t.TempDir()
	t.Cleanup(func() { os.Chmod(filepath.Join(dst, "ro"), 0o755) })
	xst, err := extractTar(bytes.NewReader(tarBytes), dst)
	must(err)
	if xst.Entries != st.Entries {
		t.Errorf("extracted %d of %d entries", xst.Entries, st.Entries)
	}
	fi, err := os.Stat(filepath.Join(dst, "bin", "run.sh"))
	must(err)
	if fi.Mode().Perm() != 0o755 {
		t.Errorf("run.sh mode %v", fi.Mode())
	}
	if fi, _ := os.Stat(filepath.Join(dst, "data.txt")); fi.Mode().Perm() != 0o640 {
		t.Errorf("data.txt mode %v", fi.Mode())
	}
	if target, err := os.Readlink(filepath.Join(dst, "link")); err != nil || target != "bin/run.sh" {
		t.Errorf("link -> %q, %v", target, err)
	}
	if target, _ := os.Readlink(filepath.Join(dst, "abs-link")); target != "/etc/passwd" {
		t.Errorf("abs-link -> %q", target)
	}
	a, _ := os.Stat(filepath.Join(dst, "data.txt"))
	b, _ := os.Stat(filepath.Join(dst, "bin", "deep", "hard.txt"))
	if a.Sys().(*syscall.Stat_t).Ino != b.Sys().(*syscall.Stat_t).Ino {
		t.Error("hard link not preserved")
	}
	if fi, _ := os.Stat(filepath.Join(dst, "ro")); fi.Mode().Perm() != 0o555 {
		t.Errorf("ro mode %v", fi.Mode())
	}
	if got, _ := os.ReadFile(filepath.Join(dst, "ro", "f")); string(got) != "x" {
		t.Errorf("ro/f = %q", got)
	}

	// gzip is detected.
	var gz bytes.Buffer
	zw := gzip.NewWriter(&gz)
	zw.Write(tarBytes)
	zw.Close()
	gzDst := t.TempDir()
	t.Cleanup(func() { os.Chmod(filepath.Join(gzDst, "ro"), 0o755) })
	if _, err := extractTar(&gz, gzDst); err != nil {
		t.Fatalf("gzip: %v", err)
	}
}

func TestExtractRefusesEscapes(t *testing.T) {
	type entry struct {
		name, link string
		typ        byte
	}
	mk := func(entries ...entry) []byte {
		var buf bytes.Buffer
		tw := tar.NewWriter(&buf)
		for _, e := range entries {
			h := &tar.Header{Name: e.name, Linkname: e.link, Typeflag: e.typ, Mode: 0o644}
			body := ""
			if e.typ == tar.TypeReg {
				body = "pwned"
				h.Size = int64(len(body))
			}
			if err := tw.WriteHeader(h); err != nil {
				t.Fatal(err)
			}
			tw.Write([]byte(body))
		}
		tw.Close()
		return buf.Bytes()
	}
	tests := []struct {
		name    string
		archive []byte
	}{
		{"dotdot", mk(entry{name: "../evil", typ: tar.TypeReg})},
		{"nested dotdot", mk(entry{name: "a/../../evil", typ: tar.TypeReg})},
		{"absolute", mk(entry{name: "/tmp/evil", typ: tar.TypeReg})},
		{"through symlink", mk(entry{name: "esc", link: "..", typ: tar.TypeSymlink}, entry{name: "esc/evil", typ: tar.TypeReg})},
		{"through abs symlink", mk(entry{name: "esc", link: "/tmp", typ: tar.TypeSymlink}, entry{name: "esc/evil", typ: tar.TypeReg})},
		{"hard link out", mk(entry{name: "h", link: "../../etc/passwd", typ: tar.TypeLink})},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			parent := t.TempDir()
			dst := filepath.Join(parent, "dst")
			if err := os.Mkdir(dst, 0o755); err != nil {
				t.Fatal(err)
			}
			if _, err := extractTar(bytes.NewReader(tt.archive), dst); err == nil {
				t.Fatal("want an error")
			}
			if _, err := os.Stat(filepath.Join(parent, "evil")); err == nil {
				t.Fatal("file written outside the target")
			}
		})
	}
}

func TestLocalTarName(t *testing.T) {
	tests := map[string]string{"./": ".", "a/b/": "a/b", "./a//b": "a/b", "a/../b": "b"}
	for in, want := range tests {
		if got, err := localTarName(in); err != nil || got != want {
			t.Errorf("%q: got %q, %v; want %q", in, got, err, want)
		}
	}
	for _, bad := range []string{"..", "../a", "/a", "a/../../b"} {
		if _, err := localTarName(bad); err == nil {
			t.Errorf("%q: want error", bad)
		}
	}
}
