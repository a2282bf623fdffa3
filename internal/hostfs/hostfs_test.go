package hostfs

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
)

func TestBuildWithBash(t *testing.T) {
	if _, err := exec.LookPath("busybox"); err != nil {
		t.Skip("needs busybox (apt-get install busybox-static)")
	}
	dir := t.TempDir()
	if err := Build(dir, Options{Bash: true}); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"bin/busybox", "bin/sh", "bin/bash", "etc/passwd"} {
		if _, err := os.Lstat(filepath.Join(dir, p)); err != nil {
			t.Errorf("missing %s: %v", p, err)
		}
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root: chroot to prove bash runs from the tree")
	}
	out, err := exec.Command("chroot", dir, "/bin/bash", "-c", "echo ok; ls / >/dev/null").CombinedOutput()
	if err != nil || string(out) != "ok\n" {
		t.Fatalf("bash in the tree: %v: %s", err, out)
	}
}
