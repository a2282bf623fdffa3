package files

import (
	"archive/tar"
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// paxTar returns a tar whose single entry carries a PAX extended header,
// and the offset where that entry's own header starts (the PAX data ends).
func paxTar(t *testing.T) ([]byte, int) {
	t.Helper()
	var buf bytes.Buffer
	tw := tar.NewWriter(&buf)
	h := &tar.Header{Typeflag: tar.TypeReg, Name: strings.Repeat("n", 150), Mode: 0644, Size: 3, Format: tar.FormatPAX}
	must(t, tw.WriteHeader(h))
	hdrStart := buf.Len() - tarBlock
	_, err := tw.Write([]byte("abc"))
	must(t, err)
	must(t, tw.Close())
	return buf.Bytes(), hdrStart
}

func TestExtractTarTruncatedWithoutMarker(t *testing.T) {
	f := newFixture(t)
	// a: 1000 bytes, so its data ends mid-block; z: two zero blocks, so the
	// stream cut right after it ends in a zero block that is not a marker.
	good := mkTar(t, file("a", strings.Repeat("a", 1000)), file("z", strings.Repeat("\x00", 1024)))
	endA := tarBlock + 1024        // a's header and padded data
	endZ := endA + tarBlock + 1024 // then z's
	if !bytes.Equal(good[endZ:], make([]byte, len(good)-endZ)) {
		t.Fatalf("unexpected layout")
	}
	pax, paxHdr := paxTar(t)
	tests := map[string]struct {
		b       []byte
		partial bool // fails with the "no end-of-archive marker" error
	}{
		"header boundary after a":      {good[:endA], true},
		"header boundary after zeros":  {good[:endZ], true},
		"gzip header boundary after a": {gz(t, good[:endA]), true},
		"gzip header boundary after z": {gz(t, good[:endZ]), true},
		"in padding":                   {good[:tarBlock+1000], true},
		"in padding after some":        {good[:tarBlock+1010], true},
		"after pax record":             {pax[:paxHdr], true},
		"gzip after pax record":        {gz(t, pax[:paxHdr]), true},
		"in pax record padding":        {pax[:paxHdr-10], true},
		"inside pax record":            {pax[:tarBlock+50], false},
		"after pax header block":       {pax[:tarBlock], false},
		"in data":                      {good[:700], false},
		"in header":                    {good[:endA+100], false},
		"in marker":                    {good[:endZ+100], false},
		"empty stream":                 {nil, true},
		"gzip of empty stream":         {gz(t, nil), true},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			p := "/" + strings.ReplaceAll(name, " ", "-")
			_, err := f.r.ExtractTar(p, bytes.NewReader(tc.b), TarOptions{})
			wantClass(t, err, errdefs.ErrInvalid)
			msg := err.Error()
			if got := strings.Contains(msg, "no end-of-archive marker"); got != tc.partial {
				t.Fatalf("error %q: marker error = %v, want %v", msg, got, tc.partial)
			}
			if tc.partial && !strings.Contains(msg, "partial") {
				t.Fatalf("error %q does not say the upload is partial", msg)
			}
		})
	}
	// Entries before the cut stay, whole; the error says how many.
	_, err := f.r.ExtractTar("/kept", bytes.NewReader(good[:endA]), TarOptions{})
	if err == nil || !strings.Contains(err.Error(), "after 1 entries") {
		t.Fatalf("error = %v", err)
	}
	if b, err := os.ReadFile(f.host("/kept/a")); err != nil || len(b) != 1000 {
		t.Fatalf("kept a: %d bytes, %v", len(b), err)
	}
}

func TestExtractTarCompleteArchives(t *testing.T) {
	f := newFixture(t)
	good := mkTar(t, file("a", strings.Repeat("a", 1000)), file("z", strings.Repeat("\x00", 1024)))
	pax, _ := paxTar(t)
	zeros := make([]byte, 2*tarBlock)
	tests := map[string]struct {
		b     []byte
		files int
	}{
		"tar.Writer":               {good, 2},
		"tar.Writer gzip":          {gz(t, good), 2},
		"tar.Writer pax":           {pax, 1},
		"one zero block":           {good[:len(good)-tarBlock], 2},
		"gzip one zero block":      {gz(t, good[:len(good)-tarBlock]), 2},
		"empty archive":            {zeros, 0},
		"gzip empty archive":       {gz(t, zeros), 0},
		"empty archive, one block": {zeros[:tarBlock], 0},
		"record padding":           {append(bytes.Clone(good), make([]byte, 10240)...), 2},
	}
	for name, tc := range tests {
		t.Run(name, func(t *testing.T) {
			res, err := f.r.ExtractTar("/"+strings.ReplaceAll(name, " ", "-"), bytes.NewReader(tc.b), TarOptions{})
			must(t, err)
			if res.Files != tc.files {
				t.Fatalf("files = %d, want %d", res.Files, tc.files)
			}
		})
	}
}

func TestExtractTarGNUTar(t *testing.T) {
	gnutar, err := exec.LookPath("tar")
	if err != nil {
		t.Skip("no tar on the host")
	}
	src := t.TempDir()
	must(t, os.MkdirAll(filepath.Join(src, "d/e"), 0755))
	must(t, os.WriteFile(filepath.Join(src, "d/a"), []byte(strings.Repeat("a", 1000)), 0644))
	must(t, os.WriteFile(filepath.Join(src, "d/e/zeros"), make([]byte, 4096), 0600))
	must(t, os.WriteFile(filepath.Join(src, strings.Repeat("long", 40)), []byte("x"), 0644))
	must(t, os.Symlink("d/a", filepath.Join(src, "link")))
	f := newFixture(t)
	for _, format := range []string{"gnu", "posix", "ustar"} {
		t.Run(format, func(t *testing.T) {
			args := []string{"--format=" + format, "-C", src, "-cf", "-", "."}
			if format == "ustar" {
				args = []string{"--format=ustar", "-C", src, "-cf", "-", "d", "link"}
			}
			out, err := exec.Command(gnutar, args...).Output()
			if err != nil {
				t.Skipf("tar %v: %v", args, err)
			}
			for _, in := range map[string][]byte{"plain": out, "gzip": gz(t, out)} {
				res, err := f.r.ExtractTar("/"+format, bytes.NewReader(in), TarOptions{})
				must(t, err)
				if res.Files < 5 {
					t.Fatalf("files = %d", res.Files)
				}
				b, err := os.ReadFile(f.host("/" + format + "/d/e/zeros"))
				if err != nil || !bytes.Equal(b, make([]byte, 4096)) {
					t.Fatalf("zeros: %d bytes, %v", len(b), err)
				}
				must(t, f.r.Remove("/"+format, true))
			}
			// GNU tar pads to 10 KiB records; cutting all zeros after the
			// last entry leaves a truncated archive.
			end := len(bytes.TrimRight(out, "\x00"))
			end = (end + tarBlock - 1) / tarBlock * tarBlock
			_, err = f.r.ExtractTar("/"+format+"-cut", bytes.NewReader(out[:end]), TarOptions{})
			wantClass(t, err, errdefs.ErrInvalid)
			if !strings.Contains(err.Error(), "no end-of-archive marker") {
				t.Fatalf("error = %v", err)
			}
		})
	}
}
