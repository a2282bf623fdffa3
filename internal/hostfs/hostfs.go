// Package hostfs assembles small root filesystems from the host's own
// binaries — Debian's static busybox, and bash with the shared libraries
// ldd reports — for the demo, benchmarks and tests, so they need no image
// download. Real environments come from layer builds and image imports.
package hostfs

import (
	"bufio"
	"bytes"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
)

// Options select what goes into the root filesystem.
type Options struct {
	// Bash adds /bin/bash and its shared libraries.
	Bash bool
	// Extra host binaries to copy (with their libraries), e.g. "/usr/bin/python3".
	Extra []string
}

// Build writes a root filesystem into dir (created if missing): busybox with
// a symlink per applet, /etc/passwd and /etc/group with root and "user"
// (uid 1000), and the requested extras.
func Build(dir string, opts Options) error {
	bb, err := exec.LookPath("busybox")
	if err != nil {
		return fmt.Errorf("finding busybox (apt-get install busybox-static): %w", err)
	}
	for _, d := range []string{"bin", "sbin", "usr/bin", "etc", "root", "tmp", "home/user", "proc", "sys", "dev", "var/tmp"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return err
		}
	}
	_ = os.Chmod(filepath.Join(dir, "tmp"), 0o1777)
	_ = os.Chown(filepath.Join(dir, "home/user"), 1000, 1000)
	if err := copyFile(bb, filepath.Join(dir, "bin/busybox"), 0o755); err != nil {
		return err
	}
	out, err := exec.Command(bb, "--list").Output()
	if err != nil {
		return fmt.Errorf("listing busybox applets: %w", err)
	}
	for _, app := range strings.Fields(string(out)) {
		if app == "busybox" || strings.ContainsRune(app, '/') {
			continue
		}
		link := filepath.Join(dir, "bin", app)
		if _, err := os.Lstat(link); err == nil {
			continue
		}
		if err := os.Symlink("busybox", link); err != nil {
			return err
		}
	}
	files := map[string]string{
		"etc/passwd":   "root:x:0:0:root:/root:/bin/sh\nuser:x:1000:1000:user:/home/user:/bin/sh\n",
		"etc/group":    "root:x:0:\nuser:x:1000:\n",
		"etc/hostname": "sandbox\n",
		"etc/hosts":    "127.0.0.1 localhost sandbox\n::1 localhost\n",
	}
	for name, content := range files {
		if err := os.WriteFile(filepath.Join(dir, name), []byte(content), 0o644); err != nil {
			return err
		}
	}
	bins := opts.Extra
	if opts.Bash {
		bash, err := exec.LookPath("bash")
		if err != nil {
			return fmt.Errorf("finding bash: %w", err)
		}
		bins = append([]string{bash}, bins...)
	}
	for _, b := range bins {
		if err := copyWithLibs(b, dir); err != nil {
			return err
		}
	}
	if opts.Bash {
		// bash lives at /bin/bash whatever the host's path.
		if _, err := os.Lstat(filepath.Join(dir, "bin/bash")); err != nil {
			bash, _ := exec.LookPath("bash")
			if err := os.Symlink(bash, filepath.Join(dir, "bin/bash")); err != nil {
				return err
			}
		}
	}
	return nil
}

// copyWithLibs copies a host binary to the same path under dir, with the
// shared libraries and loader ldd lists.
func copyWithLibs(bin, dir string) error {
	real, err := filepath.EvalSymlinks(bin)
	if err != nil {
		return fmt.Errorf("resolving %s: %w", bin, err)
	}
	paths := []string{real}
	if bin != real {
		paths = append(paths, bin)
	}
	out, err := exec.Command("ldd", real).Output()
	if err == nil {
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			for _, f := range strings.Fields(sc.Text()) {
				if strings.HasPrefix(f, "/") {
					paths = append(paths, f)
				}
			}
		}
	}
	for _, p := range paths {
		dst := filepath.Join(dir, p)
		if err := os.MkdirAll(filepath.Dir(dst), 0o755); err != nil {
			return err
		}
		if p == bin && bin != real {
			_ = os.Remove(dst)
			if err := os.Symlink(real, dst); err != nil {
				return err
			}
			continue
		}
		rp, err := filepath.EvalSymlinks(p)
		if err != nil {
			return err
		}
		if err := copyFile(rp, dst, 0o755); err != nil {
			return err
		}
	}
	return nil
}

func copyFile(src, dst string, mode os.FileMode) error {
	in, err := os.Open(src)
	if err != nil {
		return err
	}
	defer in.Close()
	_ = os.Remove(dst)
	out, err := os.OpenFile(dst, os.O_WRONLY|os.O_CREATE|os.O_TRUNC, mode)
	if err != nil {
		return err
	}
	if _, err := io.Copy(out, in); err != nil {
		out.Close()
		return err
	}
	return out.Close()
}
