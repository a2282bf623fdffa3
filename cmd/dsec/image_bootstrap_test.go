package main

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/mountinfo"
)

func TestParseBootstrap(t *testing.T) {
	ok := []string{"--suite", "bookworm", "--ref", "base/debian:12"}
	with := func(extra ...string) []string { return append(slices.Clone(ok), extra...) }
	tests := []struct {
		name    string
		args    []string
		wantErr string // substring; "" for success
		check   func(t *testing.T, c bootstrapConfig)
	}{
		{name: "defaults", args: ok, check: func(t *testing.T, c bootstrapConfig) {
			if c.suite != "bookworm" || c.ref() != "base/debian:12" || c.mirror != defaultDebianMirror ||
				c.variant != "minbase" || len(c.packages) != 0 || c.cacheDir != "" {
				t.Errorf("config %+v", c)
			}
			want := []string{"--variant=minbase", "bookworm", "/t", defaultDebianMirror}
			if got := c.debootstrapArgs("/t"); !slices.Equal(got, want) {
				t.Errorf("debootstrap args %q, want %q", got, want)
			}
		}},
		{name: "everything", args: with("--packages", "python3, git,,libstdc++6,python3", "--mirror", "https://mirror.example.org/debian/",
			"--variant", "default", "--keep-cache", "rel/cache"), check: func(t *testing.T, c bootstrapConfig) {
			if !slices.Equal(c.packages, []string{"python3", "git", "libstdc++6"}) {
				t.Errorf("packages %q", c.packages)
			}
			if c.variant != "" || !filepath.IsAbs(c.cacheDir) || !strings.HasSuffix(c.cacheDir, "/rel/cache") {
				t.Errorf("config %+v", c)
			}
			want := []string{"--include=python3,git,libstdc++6", "--cache-dir=" + c.cacheDir, "bookworm", "/t", "https://mirror.example.org/debian/"}
			if got := c.debootstrapArgs("/t"); !slices.Equal(got, want) {
				t.Errorf("debootstrap args %q, want %q", got, want)
			}
		}},
		{name: "buildd variant", args: with("--variant", "buildd")},
		{name: "no suite", args: []string{"--ref", "base/debian:12"}, wantErr: "--suite is required"},
		{name: "suite with digits", args: []string{"--suite", "debian12", "--ref", "base/debian:12"}, wantErr: "lower-case letters only"},
		{name: "suite with slash", args: []string{"--suite", "../x", "--ref", "base/debian:12"}, wantErr: "lower-case letters only"},
		{name: "suite upper case", args: []string{"--suite", "Bookworm", "--ref", "base/debian:12"}, wantErr: "lower-case letters only"},
		{name: "no ref", args: []string{"--suite", "bookworm"}, wantErr: "--ref base/NAME:TAG is required"},
		{name: "workspace ref", args: []string{"--suite", "bookworm", "--ref", "workspace/debian:12"}, wantErr: "is a workspace ref"},
		{name: "ref without tag", args: []string{"--suite", "bookworm", "--ref", "base/debian"}, wantErr: "missing :tag"},
		{name: "ref without kind", args: []string{"--suite", "bookworm", "--ref", "debian:12"}, wantErr: "want kind/name:tag"},
		{name: "package upper case", args: with("--packages", "Python3"), wantErr: `package "Python3"`},
		{name: "package one char", args: with("--packages", "a"), wantErr: `package "a"`},
		{name: "package option injection", args: with("--packages", "git,--no-check-gpg"), wantErr: `package "--no-check-gpg"`},
		{name: "package with space", args: with("--packages", "python3 git"), wantErr: `package "python3 git"`},
		{name: "package leading dot", args: with("--packages", ".hidden"), wantErr: `package ".hidden"`},
		{name: "package arch qualifier", args: with("--packages", "libc6:amd64"), wantErr: `package "libc6:amd64"`},
		{name: "mirror ftp", args: with("--mirror", "ftp://deb.debian.org/debian"), wantErr: "want an http:// or https:// URL"},
		{name: "mirror file", args: with("--mirror", "file:///srv/debian"), wantErr: "want an http:// or https:// URL"},
		{name: "mirror no host", args: with("--mirror", "http:///debian"), wantErr: "want an http:// or https:// URL"},
		{name: "mirror bare host", args: with("--mirror", "deb.debian.org/debian"), wantErr: "want an http:// or https:// URL"},
		{name: "mirror query", args: with("--mirror", "http://deb.debian.org/debian?x=1"), wantErr: "want an http:// or https:// URL"},
		{name: "mirror with credentials", args: with("--mirror", "http://u:p@deb.debian.org/debian"), wantErr: "want an http:// or https:// URL"},
		{name: "unknown variant", args: with("--variant", "fakechroot"), wantErr: `--variant "fakechroot"`},
		{name: "positional argument", args: with("extra"), wantErr: "usage: dsec image bootstrap"},
		{name: "unknown flag", args: with("--replace"), wantErr: "flag provided but not defined"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			c, err := parseBootstrap(tt.args)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("error %v, want one containing %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if tt.check != nil {
				tt.check(t, c)
			}
		})
	}
}

func TestCleanBootstrapTree(t *testing.T) {
	dir := t.TempDir()
	write := func(name, content string) {
		t.Helper()
		p := filepath.Join(dir, name)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, []byte(content), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	removed := []string{
		"var/lib/apt/lists/deb.debian.org_debian_dists_bookworm_InRelease",
		"var/lib/apt/lists/lock",
		"var/lib/apt/lists/partial/x",
		"var/cache/apt/pkgcache.bin",
		"var/cache/apt/srcpkgcache.bin",
		"var/cache/apt/archives/python3_3.11.2-1+b1_amd64.deb",
		"var/cache/apt/archives/partial/y.deb",
		"var/cache/debconf/config.dat-old",
		"var/lib/dpkg/status-old",
		"var/log/dpkg.log",
		"var/log/apt/history.log",
		"var/lib/dbus/machine-id",
	}
	kept := []string{
		"var/cache/debconf/config.dat",
		"var/lib/dpkg/status",
		"var/cache/apt/archives/lock",
		"usr/bin/python3",
	}
	for _, f := range append(slices.Clone(removed), kept...) {
		write(f, "0123456789")
	}
	write("etc/machine-id", "0123456789abcdef0123456789abcdef\n")
	write("etc/resolv.conf", "nameserver 10.0.0.1\n")
	write("etc/hostname", "buildhost\n")
	// An absolute symlink in the tree must not lead the cleaning out of it.
	outside := filepath.Join(t.TempDir(), "host-file")
	if err := os.WriteFile(outside, []byte("host"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(outside, filepath.Join(dir, "var/log/escape")); err != nil {
		t.Fatal(err)
	}

	cs, err := cleanBootstrapTree(dir)
	if err != nil {
		t.Fatal(err)
	}
	if cs.files != len(removed)+1 || cs.bytes != int64(10*len(removed)) {
		t.Errorf("removed %d files, %d bytes; want %d, %d", cs.files, cs.bytes, len(removed)+1, 10*len(removed))
	}
	for _, f := range removed {
		if _, err := os.Lstat(filepath.Join(dir, f)); err == nil {
			t.Errorf("%s is still there", f)
		}
	}
	for _, f := range append(kept, "var/log/apt", "var/lib/apt/lists", "var/cache/apt/archives/partial") {
		if _, err := os.Lstat(filepath.Join(dir, f)); err != nil {
			t.Errorf("%s: %v", f, err)
		}
	}
	if b, err := os.ReadFile(outside); err != nil || string(b) != "host" {
		t.Errorf("file outside the tree: %q, %v", b, err)
	}
	for name, want := range map[string]string{
		"etc/machine-id":  "",
		"etc/resolv.conf": "",
		"etc/hostname":    "sandbox\n",
	} {
		if b, err := os.ReadFile(filepath.Join(dir, name)); err != nil || string(b) != want {
			t.Errorf("%s = %q, %v; want %q", name, b, err, want)
		}
	}
	if b, err := os.ReadFile(filepath.Join(dir, "etc/hosts")); err != nil || !strings.Contains(string(b), "localhost") {
		t.Errorf("etc/hosts = %q, %v", b, err)
	}
}

func TestUnescapeMountPath(t *testing.T) {
	for in, want := range map[string]string{
		"/tmp/plain":         "/tmp/plain",
		`/tmp/with\040space`: "/tmp/with space",
		`/tmp/tab\011x`:      "/tmp/tab\tx",
		`/tmp/back\134slash`: `/tmp/back\slash`,
		`/tmp/short\04`:      `/tmp/short\04`,
	} {
		if got := mountinfo.Unescape(in); got != want {
			t.Errorf("mountinfo.Unescape(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestPrefixWriter(t *testing.T) {
	var out strings.Builder
	w := &prefixWriter{prefix: "  debootstrap: ", w: &out}
	w.Write([]byte("I: Retrieving InRelease\nI: Che"))
	w.Write([]byte("cking\r\n\n(Reading database ... \r(Reading database ... 5%\r"))
	w.Write([]byte("(Reading database ... 100 files)\nlast"))
	w.flush()
	want := "  debootstrap: I: Retrieving InRelease\n  debootstrap: I: Checking\n" +
		"  debootstrap: (Reading database ... 100 files)\n  debootstrap: last\n"
	if out.String() != want {
		t.Errorf("got %q, want %q", out.String(), want)
	}
}
