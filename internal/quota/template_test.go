package quota

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestTemplateCopy: a disk copied from a template is the formatted image,
// byte for byte, with its holes kept; a template is made once per size, and
// past maxTemplates the least recently used go.
func TestTemplateCopy(t *testing.T) {
	if _, err := exec.LookPath("mkfs.ext4"); err != nil {
		t.Skip("needs mkfs.ext4 (apt-get install e2fsprogs)")
	}
	dir := t.TempDir()
	const size = 64 << 20
	tmpl, err := template(dir, size, DiskInodes(size))
	if err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(tmpl)
	if err != nil {
		t.Fatal(err)
	}
	again, err := template(dir, size, DiskInodes(size))
	if err != nil || again != tmpl {
		t.Fatalf("second lookup: %q %v, want %q", again, err, tmpl)
	}
	if st2, _ := os.Stat(tmpl); !os.SameFile(st, st2) {
		t.Fatal("the template was made again")
	}
	img := filepath.Join(dir, "disk.img")
	if err := copySparse(tmpl, img); err != nil {
		t.Fatal(err)
	}
	a, _ := os.ReadFile(tmpl)
	b, _ := os.ReadFile(img)
	if len(a) != size || !bytes.Equal(a, b) {
		t.Fatalf("the copy differs from the template (%d and %d bytes)", len(a), len(b))
	}
	var s unix.Stat_t
	if err := unix.Stat(img, &s); err != nil {
		t.Fatal(err)
	}
	if s.Blocks*512 > 8<<20 {
		t.Fatalf("the copy allocates %d bytes of a %d-byte sparse image: holes were filled", s.Blocks*512, size)
	}
	if out, err := exec.Command("e2fsck", "-fn", img).CombinedOutput(); err != nil {
		t.Fatalf("e2fsck of the copy: %v\n%s", err, out)
	}
	for i := range maxTemplates + 2 {
		if _, err := template(dir, size+uint64(i+1)<<20, DiskInodes(size)); err != nil {
			t.Fatal(err)
		}
	}
	if left, _ := filepath.Glob(filepath.Join(dir, "ext4-*.img")); len(left) != maxTemplates {
		t.Fatalf("%d templates kept, want %d", len(left), maxTemplates)
	}
	if _, err := os.Stat(tmpl); !os.IsNotExist(err) {
		t.Fatalf("the least recently used template was kept: %v", err)
	}
}
