package agent

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// RunInit is the agent as the guest's pid 1: the kernel's filesystems,
// the listed modules, then Serve on the port until the host goes; then
// the guest powers off.
func RunInit() error {
	for _, m := range []struct{ src, dst, fstype string }{
		{"devtmpfs", "/dev", "devtmpfs"}, {"proc", "/proc", "proc"}, {"sysfs", "/sys", "sysfs"}, {"tmpfs", "/tmp", "tmpfs"},
	} {
		if err := os.MkdirAll(m.dst, 0o755); err != nil {
			return err
		}
		if err := unix.Mount(m.src, m.dst, m.fstype, unix.MS_NOSUID, ""); err != nil && err != unix.EBUSY {
			return fmt.Errorf("mounting %s: %w", m.dst, err)
		}
	}
	if err := loadModules(); err != nil {
		return err
	}
	port, err := FindPort(PortName, 30*time.Second)
	if err != nil {
		return err
	}
	srv := NewServer()
	// The host may go and come back (an edge restarting): each
	// connection is served in turn. While the host is away the port reads
	// EOF at once and writes block, so the "ready" of the next connection
	// waits for it.
	for {
		f, err := os.OpenFile(port, os.O_RDWR, 0)
		if err != nil {
			return fmt.Errorf("opening %s: %w", port, err)
		}
		err = srv.Serve(f)
		f.Close()
		if err != nil {
			fmt.Fprintln(os.Stderr, "dsec-agent: serving the host:", err)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// loadModules loads the modules ModulesList names, in its order.
func loadModules() error {
	b, err := os.ReadFile(ModulesList)
	if os.IsNotExist(err) {
		return nil
	}
	if err != nil {
		return err
	}
	for _, name := range strings.Fields(string(b)) {
		f, err := os.Open(filepath.Join(ModulesDir, name))
		if err != nil {
			return fmt.Errorf("loading module %s: %w", name, err)
		}
		err = unix.FinitModule(int(f.Fd()), "", 0)
		f.Close()
		if err != nil && err != unix.EEXIST {
			return fmt.Errorf("loading module %s: %w", name, err)
		}
	}
	return nil
}

// PowerOff ends the guest.
func PowerOff() {
	unix.Sync()
	// Through ACPI (the microvm machine's GED device): the VMM exits.
	_ = unix.Reboot(unix.LINUX_REBOOT_CMD_POWER_OFF)
}

// FindPort returns the device of the virtio-serial port named name,
// waiting up to within for it to appear.
func FindPort(name string, within time.Duration) (string, error) {
	deadline := time.Now().Add(within)
	for {
		ents, _ := os.ReadDir("/sys/class/virtio-ports")
		for _, e := range ents {
			n, err := os.ReadFile(filepath.Join("/sys/class/virtio-ports", e.Name(), "name"))
			if err == nil && strings.TrimSpace(string(n)) == name {
				return "/dev/" + e.Name(), nil
			}
		}
		if time.Now().After(deadline) {
			return "", fmt.Errorf("no virtio-serial port named %s after %s", name, within)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
