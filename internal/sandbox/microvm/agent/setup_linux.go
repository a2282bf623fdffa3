package agent

import (
	"encoding/base64"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/vishvananda/netlink"
	"golang.org/x/sys/unix"
)

// setup makes the sandbox: the layer disks (EROFS) under an overlay whose
// upper is on the writable disk (ext4), mounted at Root with the kernel's
// filesystems inside it; a cgroup bounding its processes; hostname and
// network. It runs once per boot.
func (s *Server) setup(su Setup) error {
	s.mu.Lock()
	done := s.root != ""
	s.mu.Unlock()
	if done {
		return fmt.Errorf("%w: the sandbox is set up already", errInvalid)
	}
	if len(su.Layers) == 0 || su.Upper == "" {
		return fmt.Errorf("%w: setup needs layer disks and a writable disk", errInvalid)
	}
	disks, err := disksBySerial(append(append([]string(nil), su.Layers...), su.Upper), 10*time.Second)
	if err != nil {
		return err
	}
	lowers := make([]string, len(su.Layers))
	for i, serial := range su.Layers {
		mp := fmt.Sprintf("/layers/%d", i)
		if err := os.MkdirAll(mp, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(disks[serial], mp, "erofs", unix.MS_RDONLY|unix.MS_NODEV, ""); err != nil {
			return fmt.Errorf("mounting layer disk %s (%s): %w", serial, disks[serial], err)
		}
		// Overlay wants the topmost lower first.
		lowers[len(su.Layers)-1-i] = mp
	}
	if err := os.MkdirAll("/rw", 0o755); err != nil {
		return err
	}
	if err := unix.Mount(disks[su.Upper], "/rw", "ext4", unix.MS_NODEV, ""); err != nil {
		return fmt.Errorf("mounting the writable disk %s: %w", disks[su.Upper], err)
	}
	for _, d := range []string{upperDir, "/rw/work", Root} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	// As the host's overlays (package layer): the upper then describes
	// its changes with plain files, whiteouts and opaque directories
	// only, so it can be packed into a snapshot layer on its own.
	opts := "lowerdir=" + strings.Join(lowers, ":") + ",upperdir=" + upperDir + ",workdir=/rw/work" +
		",index=off,redirect_dir=off,metacopy=off,xino=auto"
	// nodev: a device node that reached the upper (a snapshot's are
	// refused, and the sandbox has no CAP_MKNOD) opens nothing.
	if err := unix.Mount("overlay", Root, "overlay", unix.MS_NODEV, opts); err != nil {
		return fmt.Errorf("mounting the sandbox's overlay: %w", err)
	}
	for _, m := range []struct {
		src, dst, fstype string
		flags            uintptr
		data             string
	}{
		// /proc is the sandbox's init's to mount (contain_linux.go): one
		// mounted here would show the guest's pid namespace.
		{"sysfs", "sys", "sysfs", unix.MS_NOSUID | unix.MS_NODEV | unix.MS_NOEXEC | unix.MS_RDONLY, ""},
		// Not the guest's devtmpfs (its disks, the agent's port, /dev/mem):
		// the devices a container has.
		{"tmpfs", "dev", "tmpfs", unix.MS_NOSUID | unix.MS_NOEXEC, "mode=0755,size=64k"},
		{"devpts", "dev/pts", "devpts", unix.MS_NOSUID | unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"},
		{"shm", "dev/shm", "tmpfs", unix.MS_NOSUID | unix.MS_NODEV, "mode=1777"},
	} {
		dst := filepath.Join(Root, m.dst)
		if err := os.MkdirAll(dst, 0o755); err != nil {
			return fmt.Errorf("making %s: %w", dst, err)
		}
		if err := unix.Mount(m.src, dst, m.fstype, m.flags, m.data); err != nil {
			return fmt.Errorf("mounting %s: %w", dst, err)
		}
		if m.dst == "dev" {
			if err := makeDevices(dst); err != nil {
				return err
			}
		}
	}
	if su.ResolvConf != nil {
		if err := showFile(su.ResolvConf, "/etc/resolv.conf"); err != nil {
			return err
		}
	}
	cgfd, err := sandboxCgroup(su.Pids)
	if err != nil {
		return err
	}
	if su.Hostname != "" {
		if err := unix.Sethostname([]byte(su.Hostname)); err != nil {
			return fmt.Errorf("setting hostname: %w", err)
		}
	}
	if err := setupNetwork(su.Net); err != nil {
		return err
	}
	fr, err := openFiles(Root)
	if err != nil {
		return err
	}
	up, err := openFiles(upperDir)
	if err != nil {
		return err
	}
	// No user namespaces in the guest: the sandbox's root would hold
	// every capability in one, over kernel code its own would not reach.
	if err := os.WriteFile("/proc/sys/user/max_user_namespaces", []byte("0"), 0); err != nil {
		unix.Close(cgfd)
		return fmt.Errorf("refusing user namespaces: %w", err)
	}
	filter := base64.StdEncoding.EncodeToString(su.Seccomp)
	mb, _ := json.Marshal(masks{Masked: su.Masked, ReadOnly: su.ReadOnly})
	sp, err := s.startSpawner(Root, cgfd, filter, string(mb))
	if err != nil {
		unix.Close(cgfd)
		return err
	}
	s.mu.Lock()
	s.root, s.cgroupFD, s.files = Root, cgfd, fr
	s.upper, s.upperFS = up, "/rw"
	s.spawner, s.filter, s.masks = sp, filter, string(mb)
	s.mu.Unlock()
	return nil
}

// makeDevices fills the sandbox's /dev (a tmpfs at dev) with the devices
// a container gets.
func makeDevices(dev string) error {
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}} {
		p := filepath.Join(dev, d.name)
		if err := unix.Mknod(p, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("making %s: %w", p, err)
		}
		if err := unix.Chmod(p, 0o666); err != nil { // past the umask
			return err
		}
	}
	for name, target := range map[string]string{
		"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2",
	} {
		if err := os.Symlink(target, filepath.Join(dev, name)); err != nil {
			return err
		}
	}
	for _, d := range []string{"pts", "shm"} {
		if err := os.Mkdir(filepath.Join(dev, d), 0o755); err != nil {
			return err
		}
	}
	return nil
}

// showFile shows data read-only at path inside the sandbox (a file on the
// agent's tmpfs bound over it).
func showFile(data []byte, path string) error {
	src := filepath.Join("/tmp", filepath.Base(path))
	if err := os.WriteFile(src, data, 0o644); err != nil {
		return err
	}
	dst := filepath.Join(Root, path)
	if _, err := os.Lstat(dst); err != nil {
		// Missing, or a dangling symlink: a plain file to bind over.
		_ = os.Remove(dst)
		if err := os.WriteFile(dst, nil, 0o644); err != nil {
			return fmt.Errorf("making %s: %w", path, err)
		}
	}
	if err := unix.Mount(src, dst, "", unix.MS_BIND, ""); err != nil {
		return fmt.Errorf("showing %s: %w", path, err)
	}
	return unix.Mount("", dst, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, "")
}

// disksBySerial maps the virtio disks' serials to their devices, waiting
// up to within for all of serials to appear.
func disksBySerial(serials []string, within time.Duration) (map[string]string, error) {
	deadline := time.Now().Add(within)
	for {
		found := map[string]string{}
		ents, _ := os.ReadDir("/sys/block")
		for _, e := range ents {
			b, err := os.ReadFile(filepath.Join("/sys/block", e.Name(), "serial"))
			if err == nil {
				found[strings.TrimSpace(string(b))] = "/dev/" + e.Name()
			}
		}
		var missing []string
		for _, s := range serials {
			if found[s] == "" {
				missing = append(missing, s)
			}
		}
		if len(missing) == 0 {
			return found, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no disk with serial %s after %s", strings.Join(missing, ", "), within)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// sandboxCgroup makes the guest's cgroup for the sandbox's processes, with
// pids bounding them, and returns it opened for CLONE_INTO_CGROUP.
func sandboxCgroup(pids int64) (int, error) {
	const root = "/sys/fs/cgroup"
	if err := os.MkdirAll(root, 0o755); err != nil {
		return -1, err
	}
	if err := unix.Mount("cgroup2", root, "cgroup2", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil && !errors.Is(err, unix.EBUSY) {
		return -1, fmt.Errorf("mounting cgroup2: %w", err)
	}
	if err := os.WriteFile(filepath.Join(root, "cgroup.subtree_control"), []byte("+pids"), 0); err != nil {
		return -1, fmt.Errorf("enabling the pids controller: %w", err)
	}
	dir := filepath.Join(root, "sandbox")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return -1, err
	}
	if pids > 0 {
		if err := os.WriteFile(filepath.Join(dir, "pids.max"), []byte(strconv.FormatInt(pids, 10)), 0); err != nil {
			return -1, fmt.Errorf("setting pids.max: %w", err)
		}
	}
	fd, err := unix.Open(dir, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("opening the sandbox cgroup: %w", err)
	}
	return fd, nil
}

// setupNetwork brings lo up and, with n, addresses the interface whose
// MAC is n.MAC and routes through n.Gateway.
func setupNetwork(n *NetSetup) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	if err := netlink.LinkSetUp(lo); err != nil {
		return fmt.Errorf("bringing lo up: %w", err)
	}
	if n == nil {
		return nil
	}
	mac, err := net.ParseMAC(n.MAC)
	if err != nil {
		return fmt.Errorf("%w: mac %q", errInvalid, n.MAC)
	}
	addr, err := netlink.ParseAddr(n.Addr)
	if err != nil {
		return fmt.Errorf("%w: address %q", errInvalid, n.Addr)
	}
	gw := net.ParseIP(n.Gateway)
	if gw == nil {
		return fmt.Errorf("%w: gateway %q", errInvalid, n.Gateway)
	}
	var link netlink.Link
	for deadline := time.Now().Add(10 * time.Second); link == nil; time.Sleep(10 * time.Millisecond) {
		links, _ := netlink.LinkList()
		for _, l := range links {
			if l.Attrs().HardwareAddr.String() == mac.String() {
				link = l
			}
		}
		if link == nil && time.Now().After(deadline) {
			return fmt.Errorf("no interface with MAC %s", mac)
		}
	}
	if err := netlink.LinkSetName(link, "eth0"); err == nil {
		link, _ = netlink.LinkByName("eth0")
	}
	if err := netlink.AddrAdd(link, addr); err != nil {
		return fmt.Errorf("addressing %s: %w", link.Attrs().Name, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("bringing %s up: %w", link.Attrs().Name, err)
	}
	if err := netlink.RouteAdd(&netlink.Route{LinkIndex: link.Attrs().Index, Gw: gw}); err != nil {
		return fmt.Errorf("adding the default route: %w", err)
	}
	return nil
}
