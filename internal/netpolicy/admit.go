package netpolicy

import (
	"net/netip"
	"regexp"
	"strings"
	"sync/atomic"

	"github.com/dsecproject/dsec/internal/errdefs"
)

// Which addresses a DNS answer may admit to a sandbox's allow set. The
// answer comes from whoever serves the permitted zone, so it is hostile
// input: a permitted name that resolves to 10.0.0.1, to this host or to
// another sandbox must not open that address. Explicit CIDR entries are a
// separate path (Policy.Allow) and are not affected.

// nonGlobal are the special-purpose ranges of the IANA IPv4 and IPv6
// Special-Purpose Address Registries that net/netip's predicates
// (IsPrivate, IsLoopback, IsLinkLocalUnicast, IsMulticast, IsUnspecified,
// IsGlobalUnicast) let through. A few of them hold one or two globally
// reachable anycast addresses (192.0.0.9, 2001:4:112::/48); they stay out
// with their range: no sandbox needs them by name.
var nonGlobal = prefixes(
	"0.0.0.0/8",       // "this network" (RFC 791); netip excludes only 0.0.0.0
	"100.64.0.0/10",   // shared address space, carrier-grade NAT (RFC 6598)
	"192.0.0.0/24",    // IETF protocol assignments (RFC 6890)
	"192.0.2.0/24",    // TEST-NET-1 (RFC 5737)
	"192.88.99.0/24",  // former 6to4 relay anycast (RFC 7526)
	"198.18.0.0/15",   // benchmarking (RFC 2544)
	"198.51.100.0/24", // TEST-NET-2 (RFC 5737)
	"203.0.113.0/24",  // TEST-NET-3 (RFC 5737)
	"240.0.0.0/4",     // reserved (RFC 1112), 255.255.255.255 included
	"64:ff9b::/96",    // NAT64 (RFC 6052): would reach any IPv4 address, the filtered ones too
	"64:ff9b:1::/48",  // local-use NAT64 (RFC 8215)
	"100::/64",        // discard-only (RFC 6666)
	"2001::/23",       // IETF protocol assignments (RFC 2928), Teredo included
	"2001:db8::/32",   // documentation (RFC 3849)
	"2002::/16",       // 6to4 (RFC 3056): embeds an arbitrary IPv4 address
	"3fff::/20",       // documentation (RFC 9637)
	"5f00::/16",       // SRv6 SIDs (RFC 9602)
)

// global6 is the only IPv6 space allocated for global unicast; an IPv6
// address outside it (fec0::/10, ::/8 but ::1, ...) is never global.
var global6 = netip.MustParsePrefix("2000::/3")

func prefixes(ss ...string) []netip.Prefix {
	out := make([]netip.Prefix, len(ss))
	for i, s := range ss {
		out[i] = netip.MustParsePrefix(s)
	}
	return out
}

func inAny(ps []netip.Prefix, a netip.Addr) bool {
	for _, p := range ps {
		if p.Contains(a) {
			return true
		}
	}
	return false
}

// globalUnicast reports whether a is a globally routable unicast address.
// An IPv4-mapped IPv6 address is judged as the IPv4 address it carries.
func globalUnicast(a netip.Addr) bool {
	a = a.Unmap()
	if !a.IsValid() || a.Zone() != "" {
		return false
	}
	// IsGlobalUnicast is false for unspecified, loopback, multicast,
	// link-local and 255.255.255.255, but true for private addresses.
	if !a.IsGlobalUnicast() || a.IsPrivate() {
		return false
	}
	if a.Is6() && !global6.Contains(a) {
		return false
	}
	return !inAny(nonGlobal, a)
}

// privateRanges are the ranges Config.AdmitPrivate may open (and sandbox
// pools come from, see CheckPool).
var privateRanges = prefixes("10.0.0.0/8", "172.16.0.0/12", "192.168.0.0/16", "100.64.0.0/10")

// CheckAdmitPrivate validates a range an operator lets DNS answers admit
// although it is not globally routable: an IPv4 prefix inside 10/8,
// 172.16/12, 192.168/16 or 100.64/10. Loopback, link-local, multicast and
// reserved space cannot be opened this way.
func CheckAdmitPrivate(p netip.Prefix) error {
	if !p.IsValid() || !p.Addr().Is4() {
		return errdefs.Invalid("DNS-admitted private range %v: want an IPv4 prefix", p)
	}
	if p.Masked() != p {
		return errdefs.Invalid("DNS-admitted private range %v has host bits set (did you mean %s?)", p, p.Masked())
	}
	for _, r := range privateRanges {
		if r.Bits() <= p.Bits() && r.Contains(p.Addr()) {
			return nil
		}
	}
	return errdefs.Invalid("DNS-admitted private range %v: want a range inside 10/8, 172.16/12, 192.168/16 or 100.64/10", p)
}

// ParsePrefixes parses a comma-separated list of IPv4 or IPv6 prefixes
// or addresses (an address is its own host prefix), as the flags give
// ranges; blank items are skipped. The caller checks what a range may be.
func ParsePrefixes(list string) ([]netip.Prefix, error) {
	var out []netip.Prefix
	for _, s := range strings.Split(list, ",") {
		if s = strings.TrimSpace(s); s == "" {
			continue
		}
		p, err := netip.ParsePrefix(s)
		if err != nil {
			a, aerr := netip.ParseAddr(s)
			if aerr != nil {
				return nil, errdefs.Invalid("%q: want an address or a prefix such as 10.0.0.0/24", s)
			}
			p = netip.PrefixFrom(a, a.BitLen())
		}
		out = append(out, p)
	}
	return out, nil
}

// CheckDeny validates a range no sandbox may reach (Config.Deny): an
// IPv4 prefix without host bits. Sandboxes have no IPv6 route.
func CheckDeny(p netip.Prefix) error {
	if !p.IsValid() || !p.Addr().Is4() {
		return errdefs.Invalid("denied range %v: want an IPv4 prefix", p)
	}
	if p.Masked() != p {
		return errdefs.Invalid("denied range %v has host bits set (did you mean %s?)", p, p.Masked())
	}
	return nil
}

// addrFilter decides which addresses an answer for a permitted name may
// admit: globally routable unicast ones, and those inside a range the
// operator opened (Config.AdmitPrivate); never an address of a sandbox
// pool, one of this host's, nor one inside a denied range (Config.Deny),
// whatever the operator opened. The host's addresses change (DHCP, other
// dsec instances adding veths), so they are replaced from time to time by
// setHost; the rest is fixed at New.
type addrFilter struct {
	pools   []netip.Prefix // this edge's pool and DefaultPool
	private []netip.Prefix // Config.AdmitPrivate
	deny    []netip.Prefix // Config.Deny
	host    atomic.Pointer[[]netip.Prefix]
}

func newAddrFilter(pool netip.Prefix, private, deny []netip.Prefix) *addrFilter {
	f := &addrFilter{pools: []netip.Prefix{pool.Masked()}, private: private, deny: deny}
	if DefaultPool != pool.Masked() {
		f.pools = append(f.pools, DefaultPool)
	}
	return f
}

// setHost replaces the host's excluded prefixes (see hostExclusions).
func (f *addrFilter) setHost(ps []netip.Prefix) { f.host.Store(&ps) }

// admits reports whether a DNS answer may admit a.
func (f *addrFilter) admits(a netip.Addr) bool {
	a = a.Unmap()
	if inAny(f.pools, a) || inAny(f.deny, a) {
		return false
	}
	if h := f.host.Load(); h != nil && inAny(*h, a) {
		return false
	}
	return globalUnicast(a) || inAny(f.private, a)
}

// ifAddr is one address of a host interface, as netlink lists it.
type ifAddr struct {
	// Prefix is the address with its interface's prefix length.
	Prefix netip.Prefix
	// Label is an IPv4 address's label: the interface name, or an alias
	// such as "lo:ds1a2b3" (a dsec instance's DNS address).
	Label string
}

// dsecVethRE matches the host side of a sandbox veth of any dsec instance
// on the host (layout.hostIf: "ds", 5 hex digits of instance, 5 of slot).
var dsecVethRE = regexp.MustCompile(`^ds[0-9a-f]{10}$`)

// hostExclusions returns what of the host's addresses an answer must never
// admit: every address itself, and for a dsec veth of any instance the
// whole /30 it is on, which holds that sandbox's address too. That is how
// pools of other instances are found without knowing their configuration:
// every sandbox of theirs that has a route out has such a veth. (Their
// pools are private ranges besides, which answers admit only where the
// operator opened one.)
func hostExclusions(addrs []ifAddr) []netip.Prefix {
	var out []netip.Prefix
	for _, a := range addrs {
		if !a.Prefix.IsValid() {
			continue
		}
		ip := a.Prefix.Addr().Unmap()
		// A veth by that name with a wider prefix is not dsec's layout:
		// only its address is excluded then.
		if ip.Is4() && dsecVethRE.MatchString(a.Label) && a.Prefix.Bits() >= 24 {
			out = append(out, netip.PrefixFrom(ip, a.Prefix.Bits()).Masked())
			continue
		}
		out = append(out, netip.PrefixFrom(ip, ip.BitLen()))
	}
	return out
}
