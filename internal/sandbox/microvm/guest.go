// Package microvm runs sandboxes as virtual machines: a VMM per sandbox
// (QEMU's microvm machine where KVM cannot boot ordinary guests, as on
// this project's reference machine, which has TCG only), a Debian kernel,
// and dsec's agent as the guest's init (package microvm/agent), reached
// over a virtio-serial port.
//
// This first part boots a guest and runs commands in it. The backend
// (layers as read-only disks, a writable disk, overlay inside, limits,
// network through a tap, snapshot pause, recovery) builds on it.
package microvm

import (
	"bufio"
	"bytes"
	"context"
	"debug/elf"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
)

// Guest is what a VM boots: a kernel and an initramfs holding the agent
// as /init and the kernel modules it loads.
type Guest struct {
	Kernel, Initrd string
	// KernelPackage is the Debian package the kernel came from.
	KernelPackage string
}

// GuestModules are the modules the agent loads, in this order, each after
// its dependencies: the virtio transport and devices (the balloon reports
// the pages the guest frees), and the filesystems
// of a sandbox's disks. crc32c_generic comes first: libcrc32c (erofs,
// ext4) needs the crc32c algorithm when it loads and names it only as a
// soft dependency, which module order does not follow.
var GuestModules = []string{"crc32c_generic", "virtio_mmio", "virtio_console", "virtio_blk", "virtio_net", "virtio_balloon", "erofs", "overlay", "ext4"}

// PrepareGuest makes the guest in out from agentBin (a static dsec-agent)
// and Debian's kernel package (linux-image-amd64's kernel, downloaded into
// dir with apt-get the first time and kept there, unpacked). extra files
// are added to the initramfs (guest path → host path). It logs progress
// to progress.
func PrepareGuest(ctx context.Context, dir, out, agentBin string, extra map[string]string, progress io.Writer) (*Guest, error) {
	for _, d := range []string{dir, out} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return nil, fmt.Errorf("creating guest dir: %w", err)
		}
	}
	// Edges and tests of one host share dir.
	unlock, err := lockDir(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	deb, pkg, err := kernelDeb(ctx, dir, progress)
	if err != nil {
		return nil, err
	}
	kdir := filepath.Join(dir, "kernel-"+pkg)
	if _, err := os.Stat(filepath.Join(kdir, "boot")); err != nil {
		fmt.Fprintf(progress, "microvm: unpacking %s\n", filepath.Base(deb))
		tmp := kdir + ".tmp"
		os.RemoveAll(tmp)
		if out, err := exec.CommandContext(ctx, "dpkg-deb", "-x", deb, tmp).CombinedOutput(); err != nil {
			return nil, fmt.Errorf("unpacking %s: %w: %s", deb, err, out)
		}
		if err := os.Rename(tmp, kdir); err != nil {
			return nil, fmt.Errorf("unpacking kernel: %w", err)
		}
	}
	kernels, _ := filepath.Glob(filepath.Join(kdir, "boot", "vmlinuz-*"))
	mods, _ := filepath.Glob(filepath.Join(kdir, "lib", "modules", "*", "kernel"))
	if len(kernels) != 1 || len(mods) != 1 {
		return nil, fmt.Errorf("kernel package %s: want one vmlinuz and one module tree, found %d and %d", pkg, len(kernels), len(mods))
	}
	order, files, err := moduleOrder(mods[0], GuestModules)
	if err != nil {
		return nil, err
	}
	entries := []cpioEntry{
		{name: "init", src: agentBin, mode: 0o755},
		{name: "lib/dsec/modules/order", data: []byte(strings.Join(order, "\n") + "\n"), mode: 0o644},
	}
	for i, name := range order {
		entries = append(entries, cpioEntry{name: "lib/dsec/modules/" + name, src: files[i], mode: 0o644})
	}
	guests := make([]string, 0, len(extra))
	for g := range extra {
		guests = append(guests, g)
	}
	sort.Strings(guests)
	for _, g := range guests {
		entries = append(entries, cpioEntry{name: strings.TrimPrefix(g, "/"), src: extra[g], mode: 0o755})
	}
	initrd := filepath.Join(out, "initrd.cpio")
	if err := writeCpio(initrd, entries); err != nil {
		return nil, err
	}
	return &Guest{Kernel: kernels[0], Initrd: initrd, KernelPackage: pkg}, nil
}

// kernelDeb returns the kernel package file in dir, downloading it first
// if there is none.
func kernelDeb(ctx context.Context, dir string, progress io.Writer) (string, string, error) {
	if debs, _ := filepath.Glob(filepath.Join(dir, "linux-image-*.deb")); len(debs) > 0 {
		sort.Strings(debs)
		d := debs[len(debs)-1]
		pkg, _, _ := strings.Cut(filepath.Base(d), "_")
		return d, pkg, nil
	}
	pkg, err := kernelPackage(ctx)
	if err != nil {
		return "", "", err
	}
	fmt.Fprintf(progress, "microvm: downloading the guest kernel %s (once, into %s)\n", pkg, dir)
	download := func() ([]byte, error) {
		cmd := exec.CommandContext(ctx, "apt-get", "download", pkg)
		cmd.Dir = dir
		return cmd.CombinedOutput()
	}
	if _, err := download(); err != nil {
		if out, err := exec.CommandContext(ctx, "apt-get", "update", "-qq").CombinedOutput(); err != nil {
			return "", "", fmt.Errorf("apt-get update: %w: %s", err, out)
		}
		if out, err := download(); err != nil {
			return "", "", fmt.Errorf("downloading %s: %w: %s", pkg, err, out)
		}
	}
	debs, _ := filepath.Glob(filepath.Join(dir, pkg+"_*.deb"))
	if len(debs) != 1 {
		return "", "", fmt.Errorf("downloading %s: no package file in %s", pkg, dir)
	}
	return debs[0], pkg, nil
}

// kernelPackage is the kernel package linux-image-amd64 depends on.
func kernelPackage(ctx context.Context) (string, error) {
	out, err := exec.CommandContext(ctx, "apt-cache", "depends", "linux-image-amd64").Output()
	if err == nil {
		sc := bufio.NewScanner(bytes.NewReader(out))
		for sc.Scan() {
			f := strings.Fields(sc.Text())
			if len(f) == 2 && f[0] == "Depends:" && strings.HasPrefix(f[1], "linux-image-") {
				return f[1], nil
			}
		}
	}
	return "", fmt.Errorf("finding the kernel package of linux-image-amd64 (apt-get update first?): %v", err)
}

// moduleOrder resolves wanted modules and their dependencies (read from
// each module's .modinfo) under tree, and returns them in load order
// (dependencies first) with their paths.
func moduleOrder(tree string, wanted []string) ([]string, []string, error) {
	paths := map[string]string{}
	err := filepath.WalkDir(tree, func(p string, d os.DirEntry, err error) error {
		if err == nil && strings.HasSuffix(p, ".ko") {
			paths[strings.ReplaceAll(strings.TrimSuffix(filepath.Base(p), ".ko"), "-", "_")] = p
		}
		return nil
	})
	if err != nil {
		return nil, nil, err
	}
	var order, files []string
	seen := map[string]int{} // 1 visiting, 2 done
	var visit func(string) error
	visit = func(m string) error {
		m = strings.ReplaceAll(m, "-", "_")
		switch seen[m] {
		case 1:
			return fmt.Errorf("module %s depends on itself", m)
		case 2:
			return nil
		}
		p, ok := paths[m]
		if !ok {
			return fmt.Errorf("module %s is not in %s (built in, or missing from this kernel)", m, tree)
		}
		seen[m] = 1
		deps, err := moduleDepends(p)
		if err != nil {
			return err
		}
		for _, d := range deps {
			if err := visit(d); err != nil {
				return err
			}
		}
		seen[m] = 2
		order = append(order, filepath.Base(p))
		files = append(files, p)
		return nil
	}
	for _, m := range wanted {
		if err := visit(m); err != nil {
			return nil, nil, err
		}
	}
	return order, files, nil
}

// moduleDepends reads "depends=" from a module's .modinfo section.
func moduleDepends(path string) ([]string, error) {
	f, err := elf.Open(path)
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", path, err)
	}
	defer f.Close()
	s := f.Section(".modinfo")
	if s == nil {
		return nil, nil
	}
	b, err := s.Data()
	if err != nil {
		return nil, fmt.Errorf("reading module %s: %w", path, err)
	}
	for _, kv := range bytes.Split(b, []byte{0}) {
		if v, ok := bytes.CutPrefix(kv, []byte("depends=")); ok {
			if len(v) == 0 {
				return nil, nil
			}
			return strings.Split(string(v), ","), nil
		}
	}
	return nil, nil
}

// cpioEntry is a file of an initramfs: data, or the contents of src.
type cpioEntry struct {
	name string
	src  string
	data []byte
	mode uint32
}

// writeCpio writes entries as a newc cpio archive at path, with the
// directories they need.
func writeCpio(path string, entries []cpioEntry) error {
	tmp := path + ".tmp"
	f, err := os.Create(tmp)
	if err != nil {
		return fmt.Errorf("writing initramfs: %w", err)
	}
	defer os.Remove(tmp)
	w := bufio.NewWriterSize(f, 1<<20)
	ino := uint32(1)
	header := func(name string, mode uint32, size int) {
		fmt.Fprintf(w, "070701%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X%08X",
			ino, mode, 0, 0, 1, 0, size, 0, 0, 0, 0, len(name)+1, 0)
		ino++
		w.WriteString(name)
		w.WriteByte(0)
		pad(w, 110+len(name)+1)
	}
	dirs := map[string]bool{}
	for _, e := range entries {
		var parts []string
		for d := filepath.Dir(e.name); d != "." && d != "/"; d = filepath.Dir(d) {
			parts = append([]string{d}, parts...)
		}
		for _, d := range parts {
			if !dirs[d] {
				dirs[d] = true
				header(d, 0o040755, 0)
			}
		}
		data := e.data
		if e.src != "" {
			if data, err = os.ReadFile(e.src); err != nil {
				f.Close()
				return fmt.Errorf("writing initramfs: %w", err)
			}
		}
		header(e.name, 0o100000|e.mode, len(data))
		w.Write(data)
		pad(w, len(data))
	}
	header("TRAILER!!!", 0, 0)
	if err := w.Flush(); err != nil {
		f.Close()
		return fmt.Errorf("writing initramfs: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing initramfs: %w", err)
	}
	return os.Rename(tmp, path)
}

// pad writes zeros up to the next multiple of 4 after n bytes.
func pad(w *bufio.Writer, n int) {
	for ; n%4 != 0; n++ {
		w.WriteByte(0)
	}
}
