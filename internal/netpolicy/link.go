package netpolicy

import (
	"errors"
	"fmt"
	"net"
	"net/netip"
	"os"
	"runtime"
	"strings"

	"github.com/vishvananda/netlink"
	"github.com/vishvananda/netns"
	"golang.org/x/sys/unix"
)

// addVeth gives the network namespace of pid a veth to the host: host side
// named hostIf with host/30, sandbox side "eth0" with sbx/30 and a default
// route through host. It is idempotent: an existing pair is kept.
func addVeth(pid int, hostIf string, host, sbx netip.Addr) (err error) {
	if _, err := netlink.LinkByName(hostIf); err == nil {
		return nil
	}
	ns, err := netns.GetFromPid(pid)
	if err != nil {
		return fmt.Errorf("opening network namespace of pid %d: %w", pid, err)
	}
	defer ns.Close()

	la := netlink.NewLinkAttrs()
	la.Name = hostIf
	veth := &netlink.Veth{LinkAttrs: la, PeerName: "eth0", PeerNamespace: netlink.NsFd(ns)}
	if err := netlink.LinkAdd(veth); err != nil {
		return fmt.Errorf("creating veth %s: %w", hostIf, err)
	}
	defer func() {
		if err != nil {
			_ = delVeth(hostIf)
		}
	}()
	// The host side: no IPv6, strict reverse-path filtering (a sandbox
	// cannot send as another address, not even with IP_FREEBIND).
	for _, kv := range [][2]string{
		{"ipv6/conf/" + hostIf + "/disable_ipv6", "1"},
		{"ipv4/conf/" + hostIf + "/rp_filter", "1"},
		{"ipv4/conf/" + hostIf + "/accept_local", "0"},
	} {
		if err := writeSysctl(kv[0], kv[1]); err != nil {
			return err
		}
	}
	link, err := netlink.LinkByName(hostIf)
	if err != nil {
		return fmt.Errorf("finding veth %s: %w", hostIf, err)
	}
	if err := netlink.AddrAdd(link, &netlink.Addr{IPNet: ipNet(host, 30)}); err != nil {
		return fmt.Errorf("addressing veth %s: %w", hostIf, err)
	}
	if err := netlink.LinkSetUp(link); err != nil {
		return fmt.Errorf("bringing up veth %s: %w", hostIf, err)
	}

	h, err := netlink.NewHandleAt(ns)
	if err != nil {
		return fmt.Errorf("opening netlink in sandbox namespace: %w", err)
	}
	defer h.Close()
	peer, err := h.LinkByName("eth0")
	if err != nil {
		return fmt.Errorf("finding sandbox side of veth: %w", err)
	}
	if err := h.AddrAdd(peer, &netlink.Addr{IPNet: ipNet(sbx, 30)}); err != nil {
		return fmt.Errorf("addressing sandbox side of veth: %w", err)
	}
	if err := h.LinkSetUp(peer); err != nil {
		return fmt.Errorf("bringing up sandbox side of veth: %w", err)
	}
	gw := net.IP(host.AsSlice())
	if err := h.RouteAdd(&netlink.Route{LinkIndex: peer.Attrs().Index, Gw: gw}); err != nil {
		return fmt.Errorf("adding default route in sandbox: %w", err)
	}
	// No IPv6 inside either: the allowlist speaks IPv4 only, so an IPv6
	// address would only be a path around it.
	if err := inNetns(ns, func() error {
		return writeSysctl("ipv6/conf/all/disable_ipv6", "1")
	}); err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("disabling IPv6 in sandbox: %w", err)
	}
	return nil
}

func ipNet(a netip.Addr, bits int) *net.IPNet {
	return &net.IPNet{IP: net.IP(a.AsSlice()), Mask: net.CIDRMask(bits, 32)}
}

// delVeth deletes a host-side veth (its peer goes with it). A missing one
// is not an error.
func delVeth(name string) error {
	link, err := netlink.LinkByName(name)
	if err != nil {
		if linkGone(err) {
			return nil
		}
		return fmt.Errorf("finding veth %s: %w", name, err)
	}
	if err := netlink.LinkDel(link); err != nil && !linkGone(err) {
		return fmt.Errorf("deleting veth %s: %w", name, err)
	}
	return nil
}

// linkGone reports whether a netlink error says the link does not exist.
// The kernel removes a veth pair by itself when the sandbox's network
// namespace goes with its last process, so a delete racing with that
// finds the link and then gets ENODEV (bench soak saw it every few
// hundred deletes of networked sandboxes).
func linkGone(err error) bool {
	var nf netlink.LinkNotFoundError
	return errors.As(err, &nf) || errors.Is(err, unix.ENODEV)
}

// hostVeths lists the host interfaces whose names start with prefix.
func hostVeths(prefix string) ([]string, error) {
	links, err := netlink.LinkList()
	if err != nil {
		return nil, fmt.Errorf("listing links: %w", err)
	}
	var out []string
	for _, l := range links {
		if strings.HasPrefix(l.Attrs().Name, prefix) {
			out = append(out, l.Attrs().Name)
		}
	}
	return out, nil
}

// writeSysctl writes /proc/sys/net/<key> of the calling thread's network
// namespace.
func writeSysctl(key, value string) error {
	return os.WriteFile("/proc/sys/net/"+key, []byte(value), 0)
}

// inNetns runs fn on an OS thread that has joined ns, then returns the
// thread to its own namespace. A thread that cannot be returned is never
// unlocked, so the Go runtime retires it instead of reusing it.
func inNetns(ns netns.NsHandle, fn func() error) error {
	runtime.LockOSThread()
	orig, err := netns.Get()
	if err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("opening own network namespace: %w", err)
	}
	defer orig.Close()
	if err := netns.Set(ns); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("joining network namespace: %w", err)
	}
	ferr := fn()
	if err := netns.Set(orig); err != nil {
		return fmt.Errorf("leaving network namespace: %w", err)
	}
	runtime.UnlockOSThread()
	return ferr
}

// ensureLoAddr puts addr/32 on lo with label lo:<tag>, the DNS proxy's
// address, unless it is already there.
func ensureLoAddr(addr netip.Addr, tag string) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	a := &netlink.Addr{IPNet: ipNet(addr, 32), Label: "lo:" + tag}
	if err := netlink.AddrAdd(lo, a); err != nil && !errors.Is(err, unix.EEXIST) {
		return fmt.Errorf("adding %s to lo: %w", addr, err)
	}
	return nil
}

// delLoAddr removes the DNS proxy's address from lo.
func delLoAddr(addr netip.Addr) error {
	lo, err := netlink.LinkByName("lo")
	if err != nil {
		return fmt.Errorf("finding lo: %w", err)
	}
	if err := netlink.AddrDel(lo, &netlink.Addr{IPNet: ipNet(addr, 32)}); err != nil && !errors.Is(err, unix.EADDRNOTAVAIL) {
		return fmt.Errorf("removing %s from lo: %w", addr, err)
	}
	return nil
}

// poolInUse reports an interface other than ours holding an address in
// pool: another dsec instance or a real network uses it.
func poolInUse(pool netip.Prefix, ourPrefix string, dns netip.Addr) (string, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_V4)
	if err != nil {
		return "", fmt.Errorf("listing addresses: %w", err)
	}
	for _, a := range addrs {
		ip, ok := netip.AddrFromSlice(a.IP.To4())
		if !ok || !pool.Contains(ip) {
			continue
		}
		link, err := netlink.LinkByIndex(a.LinkIndex)
		name := "?"
		if err == nil {
			name = link.Attrs().Name
		}
		if strings.HasPrefix(name, ourPrefix) || name == "lo" && ip == dns && a.Label == "lo:"+ourPrefix {
			continue
		}
		return fmt.Sprintf("%s on %s (label %q)", ip, name, a.Label), nil
	}
	return "", nil
}

// hostAddrs lists the addresses of every interface of the host (of the
// calling thread's network namespace), in one netlink dump.
func hostAddrs() ([]ifAddr, error) {
	addrs, err := netlink.AddrList(nil, netlink.FAMILY_ALL)
	if err != nil {
		return nil, fmt.Errorf("listing addresses: %w", err)
	}
	out := make([]ifAddr, 0, len(addrs))
	for _, a := range addrs {
		if a.IPNet == nil {
			continue
		}
		ip, ok := netip.AddrFromSlice(a.IP)
		if !ok {
			continue
		}
		ones, _ := a.Mask.Size()
		out = append(out, ifAddr{Prefix: netip.PrefixFrom(ip.Unmap(), ones), Label: a.Label})
	}
	return out, nil
}
