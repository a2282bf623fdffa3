package microvm

import (
	"errors"
	"fmt"
	"net"
	"os"
	"runtime"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"

	"github.com/dsecproject/dsec/internal/sandbox/microvm/agent"
)

// A VM's network: the VMM runs in a network namespace of the VM's own,
// kept as a bind-mounted file in its directory (it outlives the VMM, which
// a pause ends and a resume starts again). The edge attaches its veth
// there as for a container (its eth0, with the sandbox's address and
// gateway; the host side carries the sandbox's allowlist). Inside, every
// frame arriving on eth0 is redirected to the VMM's tap and every frame
// from the tap out of eth0 (tc mirred, both ways), and the guest's NIC
// takes eth0's address: the guest is on the edge's network exactly where a
// container's eth0 would be, and the namespace's own stack carries nothing.

// makeNetns makes a new network namespace bound at path, with a
// persistent tap device (TapName) in it when tap is set: the VMM attaches
// to it, and it outlives a VMM that a pause ends, with the redirects
// joinTap puts on it.
func makeNetns(path string, tap bool) (err error) {
	f, err := os.OpenFile(path, os.O_CREATE|os.O_EXCL|os.O_RDONLY, 0o600)
	if err != nil {
		return fmt.Errorf("creating the VM's network namespace: %w", err)
	}
	f.Close()
	defer func() {
		if err != nil {
			os.Remove(path)
		}
	}()
	errc := make(chan error, 1)
	// A thread of its own, which ends with the goroutine if it cannot go
	// back to the host's namespace.
	go func() {
		runtime.LockOSThread()
		orig, err := netns.Get()
		if err != nil {
			errc <- err
			return
		}
		defer orig.Close()
		if err := unix.Unshare(unix.CLONE_NEWNET); err != nil {
			errc <- fmt.Errorf("unsharing: %w", err)
			runtime.UnlockOSThread()
			return
		}
		err = unix.Mount("/proc/thread-self/ns/net", path, "", unix.MS_BIND, "")
		if err == nil && tap {
			err = makeTap(TapName)
		}
		if serr := netns.Set(orig); serr == nil {
			runtime.UnlockOSThread()
		}
		errc <- err
	}()
	if err := <-errc; err != nil {
		return fmt.Errorf("creating the VM's network namespace: %w", err)
	}
	return nil
}

// makeTap makes a persistent tap device in the calling thread's network
// namespace, as the VMM opens it (no packet info, virtio-net headers).
func makeTap(name string) error {
	fd, err := unix.Open("/dev/net/tun", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("opening /dev/net/tun: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq(name)
	if err != nil {
		return err
	}
	ifr.SetUint16(unix.IFF_TAP | unix.IFF_NO_PI | unix.IFF_VNET_HDR)
	if err := unix.IoctlIfreq(fd, unix.TUNSETIFF, ifr); err != nil {
		return fmt.Errorf("creating tap %s: %w", name, err)
	}
	if err := unix.IoctlSetInt(fd, unix.TUNSETPERSIST, 1); err != nil {
		return fmt.Errorf("making tap %s persistent: %w", name, err)
	}
	return nil
}

// removeNetns unbinds and removes path (missing: nothing to do).
func removeNetns(path string) error {
	if _, err := os.Lstat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err := unix.Unmount(path, unix.MNT_DETACH); err != nil && err != unix.EINVAL && err != unix.ENOENT {
		return fmt.Errorf("unmounting the VM's network namespace: %w", err)
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("removing the VM's network namespace: %w", err)
	}
	return nil
}

// joinTap joins the edge's eth0 in the namespace at nsPath to the VMM's
// tap, both ways, and returns the guest NIC's (mac's) configuration:
// eth0's address and gateway.
func joinTap(nsPath, mac string) (*agent.NetSetup, error) {
	ns, err := netns.GetFromPath(nsPath)
	if err != nil {
		return nil, fmt.Errorf("opening the VM's network namespace: %w", err)
	}
	defer ns.Close()
	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return nil, fmt.Errorf("opening netlink in the VM's network namespace: %w", err)
	}
	defer h.Close()
	eth, err := h.LinkByName("eth0")
	if err != nil {
		return nil, fmt.Errorf("finding the edge's eth0 in the VM's namespace: %w", err)
	}
	tap, err := h.LinkByName(TapName)
	if err != nil {
		return nil, fmt.Errorf("finding the VMM's tap: %w", err)
	}
	addrs, err := h.AddrList(eth, netlink.FAMILY_V4)
	if err != nil || len(addrs) != 1 {
		return nil, fmt.Errorf("reading eth0's address: %d addresses, %v", len(addrs), err)
	}
	routes, err := h.RouteList(eth, netlink.FAMILY_V4)
	if err != nil {
		return nil, fmt.Errorf("reading eth0's routes: %w", err)
	}
	var gw net.IP
	for _, r := range routes {
		if r.Gw != nil {
			gw = r.Gw
		}
	}
	if gw == nil {
		return nil, errors.New("eth0 in the VM's namespace has no gateway")
	}
	// The namespace's own stack keeps nothing: the address is the guest's.
	if err := h.AddrDel(eth, &addrs[0]); err != nil {
		return nil, fmt.Errorf("moving eth0's address to the guest: %w", err)
	}
	hw, err := net.ParseMAC(mac)
	if err != nil {
		return nil, err
	}
	if err := h.LinkSetHardwareAddr(eth, hw); err != nil {
		return nil, fmt.Errorf("giving eth0 the guest's MAC: %w", err)
	}
	for _, l := range []netlink.Link{eth, tap} {
		if err := h.LinkSetUp(l); err != nil {
			return nil, fmt.Errorf("bringing %s up: %w", l.Attrs().Name, err)
		}
	}
	redirect := func(from, to netlink.Link) error {
		q := &netlink.Ingress{QdiscAttrs: netlink.QdiscAttrs{LinkIndex: from.Attrs().Index, Handle: netlink.MakeHandle(0xffff, 0), Parent: netlink.HANDLE_INGRESS}}
		if err := h.QdiscAdd(q); err != nil && !errors.Is(err, unix.EEXIST) {
			return fmt.Errorf("adding an ingress qdisc to %s: %w", from.Attrs().Name, err)
		}
		f := &netlink.U32{
			FilterAttrs: netlink.FilterAttrs{LinkIndex: from.Attrs().Index, Parent: netlink.MakeHandle(0xffff, 0), Priority: 1, Protocol: unix.ETH_P_ALL},
			Actions:     []netlink.Action{netlink.NewMirredAction(to.Attrs().Index)},
		}
		if err := h.FilterAdd(f); err != nil {
			return fmt.Errorf("redirecting %s to %s: %w", from.Attrs().Name, to.Attrs().Name, err)
		}
		return nil
	}
	if err := redirect(eth, tap); err != nil {
		return nil, err
	}
	if err := redirect(tap, eth); err != nil {
		return nil, err
	}
	return &agent.NetSetup{MAC: mac, Addr: addrs[0].IPNet.String(), Gateway: gw.String()}, nil
}
