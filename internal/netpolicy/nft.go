package netpolicy

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"net/netip"
	"os/exec"
	"sort"
	"strconv"
	"strings"
	"time"
)

// The host-side rules live in one nftables table per edge instance,
// "inet dsec_<instance>". Packets from a sandbox's veth are sent by a
// verdict map keyed on the interface name to that sandbox's chain; an
// interface of this instance that is not in the map is refused, so a veth
// is never open before its rules exist. Each sandbox has three sets of
// (address . protocol . port) intervals: d_N (deny), p_N (allowed entries
// inside protected ranges, which must be named explicitly) and a_N
// (everything else it may reach, DNS-admitted addresses included, those
// with a timeout). Replies are checked against the same sets, packet by
// packet, so a rule taken away also cuts connections already open.
//
// Rules are applied by piping a script to nft(8): one script is one
// atomic transaction, so a sandbox's rules change all at once.

// layout is the addressing and naming of one edge instance.
type layout struct {
	instance string         // 5 hex digits
	pool     netip.Prefix   // sandbox addresses
	deny     []netip.Prefix // ranges no sandbox reaches (Config.Deny)
}

func (l layout) table() string { return "dsec_" + l.instance }

// ifPrefix is the name prefix of this instance's host-side veths.
func (l layout) ifPrefix() string { return "ds" + l.instance }

// hostIf is the host-side veth of slot n (15 bytes at most: IFNAMSIZ-1).
func (l layout) hostIf(n int) string { return fmt.Sprintf("%s%05x", l.ifPrefix(), n) }

// dnsAddr is where the DNS proxy listens: the first host address of the
// pool, whose /30 (slot 0) is never given to a sandbox.
func (l layout) dnsAddr() netip.Addr { return l.pool.Addr().Next() }

// slotAddrs are the host-side and sandbox-side addresses of slot n: the
// n-th /30 of the pool.
func (l layout) slotAddrs(n int) (host, sbx netip.Addr) {
	b := l.pool.Addr().As4()
	v := uint32(b[0])<<24 | uint32(b[1])<<16 | uint32(b[2])<<8 | uint32(b[3])
	v += uint32(n) * 4
	host = netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v + 1)})
	sbx = netip.AddrFrom4([4]byte{byte(v >> 24), byte(v >> 16), byte(v >> 8), byte(v + 2)})
	return host, sbx
}

// slots is how many sandboxes the pool can address (slot 0 is the DNS
// proxy's).
func (l layout) slots() int { return 1<<(32-l.pool.Bits())/4 - 1 }

// protected are ranges a sandbox reaches only through an allow entry that
// lies inside them: other sandboxes, link-local (cloud metadata), this
// host's loopback range, "this network", multicast and reserved space.
func (l layout) protected() []string {
	return []string{l.pool.String(), "169.254.0.0/16", "0.0.0.0/8", "127.0.0.0/8", "224.0.0.0/3"}
}

// isProtected reports whether e lies entirely inside a protected range.
func (l layout) isProtected(e Entry) bool {
	for _, s := range l.protected() {
		p := netip.MustParsePrefix(s)
		if p.Bits() <= e.Prefix.Bits() && p.Contains(e.Prefix.Addr()) {
			return true
		}
	}
	return false
}

// baseScript creates the table and (re)writes its shared chains. Adding
// what exists is a no-op in nft, so it is safe on every start.
func (l layout) baseScript() string {
	var b strings.Builder
	t := "inet " + l.table()
	ifp := l.ifPrefix() + "*"
	fmt.Fprintf(&b, "add table %s\n", t)
	fmt.Fprintf(&b, "add set %s protected { type ipv4_addr; flags interval; }\n", t)
	fmt.Fprintf(&b, "add set %s denied { type ipv4_addr; flags interval; }\n", t)
	fmt.Fprintf(&b, "add map %s egress { type ifname : verdict; }\n", t)
	fmt.Fprintf(&b, "add map %s ingress { type ifname : verdict; }\n", t)
	// Priority just before the usual filter chains, so that our verdict
	// on sandbox traffic is taken first; an accept here does not bypass
	// other tables' drops (netfilter runs every base chain).
	fmt.Fprintf(&b, "add chain %s forward { type filter hook forward priority -5; policy accept; }\n", t)
	fmt.Fprintf(&b, "add chain %s input { type filter hook input priority -5; policy accept; }\n", t)
	fmt.Fprintf(&b, "add chain %s postrouting { type nat hook postrouting priority srcnat; policy accept; }\n", t)
	fmt.Fprintf(&b, "flush set %s protected\n", t)
	fmt.Fprintf(&b, "add element %s protected { %s }\n", t, strings.Join(l.protected(), ", "))
	fmt.Fprintf(&b, "flush set %s denied\n", t)
	if len(l.deny) > 0 {
		var ds []string
		for _, d := range l.deny {
			ds = append(ds, d.String())
		}
		fmt.Fprintf(&b, "add element %s denied { %s }\n", t, strings.Join(ds, ", "))
	}
	// refuse answers a refused packet at once (TCP reset, ICMP
	// admin-prohibited otherwise), so that a blocked connect fails fast
	// instead of timing out. ICMP errors are rate-limited by the kernel;
	// resets are not, so a port scan ends quickly too.
	fmt.Fprintf(&b, "add chain %s refuse\nflush chain %s refuse\n", t, t)
	fmt.Fprintf(&b, "add rule %s refuse %s\n", t, rejectTCP)
	fmt.Fprintf(&b, "add rule %s refuse %s\n", t, rejectOther)
	fmt.Fprintf(&b, "flush chain %s forward\n", t)
	fmt.Fprintf(&b, "add rule %s forward iifname %q iifname vmap @egress\n", t, ifp)
	fmt.Fprintf(&b, "add rule %s forward iifname %q %s\n", t, ifp, rejectTCP)
	fmt.Fprintf(&b, "add rule %s forward iifname %q %s\n", t, ifp, rejectOther)
	fmt.Fprintf(&b, "add rule %s forward oifname %q oifname vmap @ingress\n", t, ifp)
	fmt.Fprintf(&b, "add rule %s forward oifname %q drop\n", t, ifp)
	// The host itself (every address it has, the edge's API included) is
	// closed to sandboxes but for the DNS proxy.
	fmt.Fprintf(&b, "flush chain %s input\n", t)
	fmt.Fprintf(&b, "add rule %s input iifname %q ip daddr %s meta l4proto { tcp, udp } th dport 53 accept\n", t, ifp, l.dnsAddr())
	fmt.Fprintf(&b, "add rule %s input iifname %q %s\n", t, ifp, rejectTCP)
	fmt.Fprintf(&b, "add rule %s input iifname %q %s\n", t, ifp, rejectOther)
	fmt.Fprintf(&b, "flush chain %s postrouting\n", t)
	fmt.Fprintf(&b, "add rule %s postrouting ip saddr %s oifname != %q masquerade\n", t, l.pool, ifp)
	return b.String()
}

const (
	rejectTCP   = "meta l4proto tcp reject with tcp reset"
	rejectOther = "reject with icmpx admin-prohibited"
)

// dynEntry is an address admitted by the DNS proxy until expires.
type dynEntry struct {
	addr    netip.Addr
	ports   Ports
	expires time.Time
}

// slotScript (re)writes slot n's sets and chains for p, keeping the
// DNS-admitted entries dyn that have not expired at now.
func (l layout) slotScript(n int, p *Policy, dyn []dynEntry, now time.Time) string {
	var b strings.Builder
	t := "inet " + l.table()
	_, sbx := l.slotAddrs(n)
	key := "ipv4_addr . inet_proto . inet_service"
	for _, s := range []string{"a", "p"} {
		fmt.Fprintf(&b, "add set %s %s_%d { type %s; flags interval,timeout; }\n", t, s, n, key)
	}
	fmt.Fprintf(&b, "add set %s d_%d { type %s; flags interval; }\n", t, n, key)
	for _, s := range []string{"a", "p", "d"} {
		fmt.Fprintf(&b, "flush set %s %s_%d\n", t, s, n)
	}
	var allow, prot []string
	for _, e := range p.Allow {
		if l.isProtected(e) {
			prot = append(prot, element(e.Prefix, e.Ports, 0))
		} else {
			allow = append(allow, element(e.Prefix, e.Ports, 0))
		}
	}
	for _, d := range dyn {
		if left := d.expires.Sub(now); left > time.Second {
			e := Entry{netip.PrefixFrom(d.addr, 32), d.ports}
			if l.isProtected(e) || inAny(l.deny, d.addr) {
				continue // a name never admits a protected or denied address
			}
			allow = append(allow, element(e.Prefix, e.Ports, left))
		}
	}
	var deny []string
	for _, e := range p.Deny {
		deny = append(deny, element(e.Prefix, e.Ports, 0))
	}
	for _, x := range []struct {
		set   string
		elems []string
	}{{"a", allow}, {"p", prot}, {"d", deny}} {
		if len(x.elems) > 0 {
			fmt.Fprintf(&b, "add element %s %s_%d { %s }\n", t, x.set, n, strings.Join(dedupe(x.elems), ", "))
		}
	}
	match := "ip daddr . meta l4proto . th dport"
	reply := "ip saddr . meta l4proto . th sport"
	fmt.Fprintf(&b, "add chain %s e_%d\n", t, n)
	fmt.Fprintf(&b, "flush chain %s e_%d\n", t, n)
	fmt.Fprintf(&b, "add rule %s e_%d ip saddr != %s drop\n", t, n, sbx)
	fmt.Fprintf(&b, "add rule %s e_%d ip daddr @denied goto refuse\n", t, n)
	fmt.Fprintf(&b, "add rule %s e_%d %s @d_%d goto refuse\n", t, n, match, n)
	fmt.Fprintf(&b, "add rule %s e_%d %s @p_%d accept\n", t, n, match, n)
	fmt.Fprintf(&b, "add rule %s e_%d ip daddr @protected goto refuse\n", t, n)
	fmt.Fprintf(&b, "add rule %s e_%d %s @a_%d accept\n", t, n, match, n)
	fmt.Fprintf(&b, "add rule %s e_%d goto refuse\n", t, n)
	fmt.Fprintf(&b, "add chain %s i_%d\n", t, n)
	fmt.Fprintf(&b, "flush chain %s i_%d\n", t, n)
	// ICMP errors about the sandbox's other connections may come from a
	// denied range (the gateway of a denied node network): they pass on
	// to the related rule below.
	fmt.Fprintf(&b, "add rule %s i_%d ip saddr @denied ct state != related drop\n", t, n)
	fmt.Fprintf(&b, "add rule %s i_%d ct state established %s @d_%d drop\n", t, n, reply, n)
	fmt.Fprintf(&b, "add rule %s i_%d ct state established %s @p_%d accept\n", t, n, reply, n)
	fmt.Fprintf(&b, "add rule %s i_%d ct state established ip saddr @protected drop\n", t, n)
	fmt.Fprintf(&b, "add rule %s i_%d ct state established %s @a_%d accept\n", t, n, reply, n)
	fmt.Fprintf(&b, "add rule %s i_%d ct state related meta l4proto icmp accept\n", t, n)
	fmt.Fprintf(&b, "add rule %s i_%d drop\n", t, n)
	fmt.Fprintf(&b, "add element %s egress { %q : goto e_%d }\n", t, l.hostIf(n), n)
	fmt.Fprintf(&b, "add element %s ingress { %q : goto i_%d }\n", t, l.hostIf(n), n)
	return b.String()
}

// dynScript adds DNS-admitted entries to slot n's allow set.
func (l layout) dynScript(n int, dyn []dynEntry, now time.Time) string {
	var elems []string
	for _, d := range dyn {
		e := Entry{netip.PrefixFrom(d.addr, 32), d.ports}
		if left := d.expires.Sub(now); left > time.Second && !l.isProtected(e) {
			elems = append(elems, element(e.Prefix, e.Ports, left))
		}
	}
	if len(elems) == 0 {
		return ""
	}
	return fmt.Sprintf("add element inet %s a_%d { %s }\n", l.table(), n, strings.Join(dedupe(elems), ", "))
}

// removeScript deletes slot n's map entries, chains and sets. Each object
// is added first, so the script succeeds whether or not it existed.
func (l layout) removeScript(n int) string {
	var b strings.Builder
	t := "inet " + l.table()
	key := "ipv4_addr . inet_proto . inet_service"
	fmt.Fprintf(&b, "add chain %s e_%d\nadd chain %s i_%d\n", t, n, t, n)
	fmt.Fprintf(&b, "add element %s egress { %q : goto e_%d }\n", t, l.hostIf(n), n)
	fmt.Fprintf(&b, "add element %s ingress { %q : goto i_%d }\n", t, l.hostIf(n), n)
	fmt.Fprintf(&b, "delete element %s egress { %q }\n", t, l.hostIf(n))
	fmt.Fprintf(&b, "delete element %s ingress { %q }\n", t, l.hostIf(n))
	fmt.Fprintf(&b, "flush chain %s e_%d\nflush chain %s i_%d\n", t, n, t, n)
	fmt.Fprintf(&b, "delete chain %s e_%d\ndelete chain %s i_%d\n", t, n, t, n)
	for _, s := range []string{"a", "p"} {
		fmt.Fprintf(&b, "add set %s %s_%d { type %s; flags interval,timeout; }\n", t, s, n, key)
		fmt.Fprintf(&b, "delete set %s %s_%d\n", t, s, n)
	}
	fmt.Fprintf(&b, "add set %s d_%d { type %s; flags interval; }\n", t, n, key)
	fmt.Fprintf(&b, "delete set %s d_%d\n", t, n)
	return b.String()
}

// element renders one set element; timeout 0 means none.
func element(p netip.Prefix, ports Ports, timeout time.Duration) string {
	addr := p.String()
	if p.Bits() == 32 {
		addr = p.Addr().String()
	}
	proto := "0-255"
	if ports.Proto != ProtoAny {
		proto = strconv.Itoa(int(ports.Proto))
	}
	port := strconv.Itoa(int(ports.Lo))
	if ports.Hi != ports.Lo {
		port += "-" + strconv.Itoa(int(ports.Hi))
	}
	s := addr + " . " + proto + " . " + port
	if timeout > 0 {
		s += " timeout " + strconv.Itoa(int(timeout.Seconds())) + "s"
	}
	return s
}

func dedupe(s []string) []string {
	seen := map[string]bool{}
	out := s[:0:0]
	for _, x := range s {
		if !seen[x] {
			seen[x] = true
			out = append(out, x)
		}
	}
	return out
}

// nft runs a script as one transaction.
func nft(ctx context.Context, script string) error {
	ctx, cancel := context.WithTimeout(ctx, 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, "nft", "-f", "-")
	cmd.Stdin = strings.NewReader(script)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	if err := cmd.Run(); err != nil {
		return fmt.Errorf("nft: %v: %s", err, strings.TrimSpace(out.String()))
	}
	return nil
}

// tableSlots lists the slots that have objects in the instance's table,
// or nil when the table does not exist.
func (l layout) tableSlots(ctx context.Context) (map[int]bool, bool, error) {
	out, err := exec.CommandContext(ctx, "nft", "-j", "list", "table", "inet", l.table()).Output()
	if err != nil {
		// nft says "No such file or directory" for a missing table.
		if ee, ok := err.(*exec.ExitError); ok && bytes.Contains(ee.Stderr, []byte("No such file")) {
			return nil, false, nil
		}
		return nil, false, fmt.Errorf("listing nftables table %s: %w", l.table(), err)
	}
	var doc struct {
		Nftables []map[string]json.RawMessage `json:"nftables"`
	}
	if err := json.Unmarshal(out, &doc); err != nil {
		return nil, false, fmt.Errorf("decoding nft -j output: %w", err)
	}
	slots := map[int]bool{}
	for _, obj := range doc.Nftables {
		for _, kind := range []string{"chain", "set"} {
			raw, ok := obj[kind]
			if !ok {
				continue
			}
			var o struct {
				Name string `json:"name"`
			}
			if json.Unmarshal(raw, &o) != nil {
				continue
			}
			if _, num, ok := strings.Cut(o.Name, "_"); ok && len(o.Name) > 2 && o.Name[1] == '_' {
				if n, err := strconv.Atoi(num); err == nil {
					slots[n] = true
				}
			}
		}
	}
	return slots, true, nil
}

func sortedSlots(m map[int]bool) []int {
	var out []int
	for n := range m {
		out = append(out, n)
	}
	sort.Ints(out)
	return out
}
